"""OpenAI's APIs, a module each: `chat`, `completions`, `models`, `responses` (its bodies
in `responses_request`), `embeddings`; `generation` holds what chat and text completions
share."""

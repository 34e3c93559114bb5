"""vLLM's own endpoints beside OpenAI's: `tokenize` (/tokenize, /detokenize) and `scores`
(/v1/rerank, /v1/score)."""

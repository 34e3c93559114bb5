"""What one request asks for and how its tokens are chosen and ended, one request at a time:
sampling (`sampling/`: parameters, logits processors, the sampler; `chat_defaults`: how a chat samples when nobody chose), a
grammar that constrains it (`grammar`), stop strings (`stopping`), tool calls in each
family's format (`tool_calls`), scores and pooled embeddings (`scoring`, `pooling`), and
the per-request state the engine keeps (`state`). Nothing here knows about batches or
KV blocks."""

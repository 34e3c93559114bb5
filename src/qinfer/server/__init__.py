"""The OpenAI-compatible HTTP server (`qinfer serve`): FastAPI over the AsyncEngine."""

"""The serving engine: a paged KV block pool with prefix caching, continuous batching,
the offline `LLM` API and the `AsyncEngine` the server runs on.

sequence.py (one request's tokens and blocks) -> block_manager.py (who owns which block,
prefix caching) -> scheduler.py (who runs next) -> `qinfer.runtime.executor` (one step through
the model on every rank: a `ForwardBatch` over the paged attention backend) -> engine.py (sampling,
stopping, outputs) -> llm.py / async_engine.py.
"""

from qinfer.engine.async_engine import AsyncEngine
from qinfer.engine.config import EngineConfig
from qinfer.engine.engine import Engine
from qinfer.engine.llm import LLM
from qinfer.engine.outputs import RequestOutput, TokenLogprob
from qinfer.engine.stats import EngineStats

__all__ = [
    "LLM",
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "RequestOutput",
    "TokenLogprob",
]

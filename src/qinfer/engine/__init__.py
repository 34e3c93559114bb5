"""The serving engine: a paged KV block pool with prefix caching, continuous batching,
the offline `LLM` API and the `AsyncEngine` the server runs on.

sequence.py (one request's tokens and blocks) -> block_manager.py (who owns which block,
prefix caching) -> scheduler.py (who runs next) -> `qinfer.runtime.executor` (one step through
the model on every rank: a `ForwardBatch` over the paged attention backend) -> engine.py (sampling,
stopping, outputs) -> llm.py / async_engine.py. build.py makes an engine from a checkpoint
(`LoadConfig`); args.py holds the command-line flags that say how.

The names below are imported on first use (PEP 562), as the package's face does: the
command line reads `qinfer.engine.args` before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qinfer.engine.async_engine import AsyncEngine
    from qinfer.engine.config import EngineConfig
    from qinfer.engine.engine import Engine
    from qinfer.engine.llm import LLM
    from qinfer.engine.outputs import RequestOutput, TokenLogprob
    from qinfer.engine.stats import EngineStats

#: Public name -> the module that defines it.
_EXPORTS = {
    "LLM": "qinfer.engine.llm",
    "AsyncEngine": "qinfer.engine.async_engine",
    "Engine": "qinfer.engine.engine",
    "EngineConfig": "qinfer.engine.config",
    "EngineStats": "qinfer.engine.stats",
    "RequestOutput": "qinfer.engine.outputs",
    "TokenLogprob": "qinfer.engine.outputs",
}

__all__ = [
    "LLM",
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "RequestOutput",
    "TokenLogprob",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qinfer.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value

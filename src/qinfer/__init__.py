"""qinfer: a small, readable inference engine for Qwen3 and its relatives.

The names below are imported on first use (PEP 562), not with the package: `import qinfer`
(which `qinfer --help` and `qinfer --version` do) then costs milliseconds instead of
torch's second or more. No public name may also be a submodule's: importing the submodule
would bind the module under that name (`generate` is the function; its module is
`qinfer.engine.generation`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from qinfer.core.version import VERSION

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and readers
    from qinfer.core.errors import QinferError
    from qinfer.core.features import Features
    from qinfer.core.model_config import ModelConfig
    from qinfer.engine import LLM, AsyncEngine, RequestOutput
    from qinfer.engine.generation import GenerationResult, generate, stream_generate
    from qinfer.model.loading import load_model
    from qinfer.model.transformer import Transformer
    from qinfer.request.pooling import PoolingParams
    from qinfer.request.sampling import SamplingParams
    from qinfer.text.tokenizer import Tokenizer, load_tokenizer

#: Public name -> the module that defines it.
_EXPORTS = {
    "LLM": "qinfer.engine",
    "AsyncEngine": "qinfer.engine",
    "RequestOutput": "qinfer.engine",
    "Features": "qinfer.core.features",
    "GenerationResult": "qinfer.engine.generation",
    "ModelConfig": "qinfer.core.model_config",
    "PoolingParams": "qinfer.request.pooling",
    "QinferError": "qinfer.core.errors",
    "SamplingParams": "qinfer.request.sampling",
    "Tokenizer": "qinfer.text.tokenizer",
    "Transformer": "qinfer.model.transformer",
    "generate": "qinfer.engine.generation",
    "load_model": "qinfer.model.loading",
    "load_tokenizer": "qinfer.text.tokenizer",
    "stream_generate": "qinfer.engine.generation",
}

__all__ = [
    "LLM",
    "AsyncEngine",
    "RequestOutput",
    "Features",
    "GenerationResult",
    "ModelConfig",
    "PoolingParams",
    "QinferError",
    "SamplingParams",
    "Tokenizer",
    "Transformer",
    "generate",
    "load_model",
    "load_tokenizer",
    "stream_generate",
]

__version__ = VERSION


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qinfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

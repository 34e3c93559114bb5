"""qinfer: a small, readable inference engine for Qwen3 and its relatives."""

from qinfer.config import ModelConfig
from qinfer.engine import LLM, AsyncEngine, RequestOutput
from qinfer.errors import QinferError
from qinfer.features import Features
from qinfer.generate import GenerationResult, generate, stream_generate
from qinfer.model import Transformer, load_model
from qinfer.pooling import PoolingParams
from qinfer.sampling import SamplingParams
from qinfer.tokenizer import Tokenizer, load_tokenizer

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

"""qinfer: a small, readable inference engine for Qwen3 and its relatives."""

from qinfer.config import ModelConfig
from qinfer.errors import QinferError
from qinfer.features import Features
from qinfer.model import Transformer, load_model

__all__ = ["Features", "ModelConfig", "QinferError", "Transformer", "load_model"]

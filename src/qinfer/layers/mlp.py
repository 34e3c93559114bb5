"""The SwiGLU feed-forward network: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qinfer.config import ModelConfig
from qinfer.layers.linear import linear
from qinfer.weights.base import Weights


class MLP:
    """(B, L, hidden) -> (B, L, intermediate) -> (B, L, hidden)."""

    def __init__(self, layer_prefix: str, config: ModelConfig, weights: Weights) -> None:
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate = weights.linear(f"{layer_prefix}.mlp.gate_proj", (inter, hidden), bias)
        self.up = weights.linear(f"{layer_prefix}.mlp.up_proj", (inter, hidden), bias)
        self.down = weights.linear(f"{layer_prefix}.mlp.down_proj", (hidden, inter), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(F.silu(linear(x, self.gate)) * linear(x, self.up), self.down)

"""The SwiGLU feed-forward network: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qinfer.config import ModelConfig
from qinfer.linear import linear
from qinfer.weights.base import Weights


class MLP:
    """(B, L, hidden) -> (B, L, intermediate) -> (B, L, hidden)."""

    def __init__(self, layer_prefix: str, config: ModelConfig, weights: Weights) -> None:
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        prefix = f"{layer_prefix}.mlp"
        # gate and up loaded as one projection (rows stacked): one kernel call per step.
        self.gate_up = weights.linear(
            [f"{prefix}.gate_proj", f"{prefix}.up_proj"], (inter, hidden), bias
        )
        self.down = weights.linear(f"{prefix}.down_proj", (hidden, inter), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up).chunk(
            2, dim=-1
        )  # (B, L, 2 * inter) -> 2 x (B, L, inter)
        return linear(F.silu(gate) * up, self.down)

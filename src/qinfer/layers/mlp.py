"""The gated feed-forward network: down(act(gate(x)) * up(x)), with act SiLU (SwiGLU) or
the tanh-approximated GELU (GeGLU, Gemma) as the config's `hidden_act` says.

Under tensor parallelism (`qinfer.parallel`) a rank holds intermediate / N of the FFN
channels: gate/up are column-parallel (its channels), down is row-parallel (its call
all-reduces the ranks' sums).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from qinfer.config import ModelConfig
from qinfer.linear import linear
from qinfer.parallel import SINGLE, Parallel
from qinfer.weights.base import Weights

#: `ModelConfig.hidden_act` -> the function applied to the gate.
GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


class MLP:
    """(B, L, hidden) -> (B, L, intermediate / N) -> (B, L, hidden); N = 1 in one process."""

    def __init__(
        self, layer_prefix: str, config: ModelConfig, weights: Weights, parallel: Parallel = SINGLE
    ) -> None:
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        channels = parallel.shard_range(inter, "FFN channels")  # this rank's
        prefix = f"{layer_prefix}.mlp"
        # gate and up loaded as one projection (rows stacked): one kernel call per step.
        self.gate_up = weights.linear(
            [f"{prefix}.gate_proj", f"{prefix}.up_proj"],
            (inter, hidden),
            bias,
            shard=parallel.split_out(channels, channels),
        )
        self.down = weights.linear(
            f"{prefix}.down_proj", (hidden, inter), bias, shard=parallel.split_in(channels)
        )
        self.activation = GATE_ACTIVATIONS[config.hidden_act]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # (B, L, 2 * inter / N) -> 2 x (B, L, inter / N)
        gate, up = linear(x, self.gate_up).chunk(2, dim=-1)
        # row-parallel down: the ranks' partial sums all-reduced, (B, L, hidden)
        return linear(self.activation(gate) * up, self.down)

"""The gated feed-forward network: down(act(gate(x)) * up(x)), with act SiLU (SwiGLU) or
the tanh-approximated GELU (GeGLU, Gemma) as the config's `wiring.hidden_act` says.

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
from qinfer.linear import Linear, linear
from qinfer.parallel import SINGLE, Parallel
from qinfer.weights.base import Weights

#: `Wiring.hidden_act` -> the function applied to the gate.
GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


class MLP:
    """(B, L, hidden) -> (B, L, intermediate / N) -> (B, L, hidden); N = 1 in one process."""

    def __init__(
        self, layer_prefix: str, config: ModelConfig, weights: Weights, parallel: Parallel = SINGLE
    ) -> None:
        self.gate_up, self.down = load_gated_ffn(
            f"{layer_prefix}.mlp",
            config.intermediate_size,
            "FFN channels",
            config,
            weights,
            parallel,
            bias=config.wiring.mlp_bias,
        )
        self.activation = GATE_ACTIVATIONS[config.wiring.hidden_act]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # (B, L, 2 * inter / N) -> (B, L, inter / N)
        gated = gate_times_up(linear(x, self.gate_up), self.activation)
        # row-parallel down: the ranks' partial sums all-reduced, (B, L, hidden)
        return linear(gated, self.down)


def load_gated_ffn(
    prefix: str,
    width: int,
    what: str,
    config: ModelConfig,
    weights: Weights,
    parallel: Parallel,
    bias: bool = False,
) -> tuple[Linear, Linear]:
    """(gate_up, down) of the gated FFN at `prefix` ({prefix}.gate_proj, .up_proj,
    .down_proj), this rank's share of its `width` channels (`what` names them in a
    refusal): gate and up loaded as one projection (rows stacked), one kernel call per
    step; down split by its input channels (row-parallel)."""
    channels = parallel.shard_range(width, what)  # this rank's
    gate_up = weights.linear(
        [f"{prefix}.gate_proj", f"{prefix}.up_proj"],
        (width, config.hidden_size),
        bias,
        shard=parallel.split_out(channels, channels),
    )
    down = weights.linear(
        f"{prefix}.down_proj", (config.hidden_size, width), bias, shard=parallel.split_in(channels)
    )
    return gate_up, down


def gate_times_up(
    gate_up: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """gate_up (..., 2 * width), gate then up -> activation(gate) * up (..., width)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return activation(gate) * up

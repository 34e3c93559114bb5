"""The gated feed-forward network: down(act(gate(x)) * up(x)), with act SiLU (SwiGLU) or
the tanh-approximated GELU (GeGLU, Gemma) as the config's `wiring.hidden_act` says.

Under tensor parallelism (`qinfer.core.parallel`) a rank holds intermediate / N of the FFN
channels: gate/up are column-parallel (its channels), down is row-parallel (its call
all-reduces the ranks' sums).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from qinfer import kernels
from qinfer.core.forward_batch import AdapterRows
from qinfer.core.model_config import ModelConfig
from qinfer.core.module import Module
from qinfer.core.parallel import Parallel, Shard
from qinfer.linear import linear
from qinfer.weights.slots import LinearSlot, LinearSource

#: `Wiring.hidden_act` -> the function applied to the gate.
GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


class MLP(Module):
    """(*P, hidden) -> (*P, intermediate / N) -> (*P, hidden); N = 1 in one process.
    Slots `gate_up` (gate and up fused) and `down`."""

    def __init__(self, layer_prefix: str, config: ModelConfig) -> None:
        super().__init__()
        sources = gated_ffn_sources(
            f"{layer_prefix}.mlp",
            config.intermediate_size,
            "FFN channels",
            config.hidden_size,
            bias=config.wiring.mlp_bias,
        )
        self.gate_up, self.down = (LinearSlot(source) for source in sources)
        self.activation = GATE_ACTIVATIONS[config.wiring.hidden_act]

    def forward(self, x: torch.Tensor, adapters: AdapterRows | None = None) -> torch.Tensor:
        """adapters: the batch's LoRA rows (`ForwardBatch.adapters`), x then (T, hidden)."""
        # (*P, 2 * inter / N) -> (*P, inter / N)
        gated = gate_times_up(linear(x, self.gate_up, adapters), self.activation)
        # row-parallel down: the ranks' partial sums all-reduced, (*P, hidden)
        return linear(gated, self.down, adapters)


def gated_ffn_sources(
    prefix: str, width: int, what: str, hidden: int, bias: bool = False, reduced: bool = True
) -> tuple[LinearSource, LinearSource]:
    """The sources of (gate_up, down) of the gated FFN at `prefix` ({prefix}.gate_proj,
    .up_proj, .down_proj) of `width` channels (`what` names them in a tensor-parallel
    refusal): gate and up read as one projection (rows stacked), one kernel call per step,
    a rank's share of the channels each; down split by its input channels (row-parallel,
    its partial sums all-reduced in its call unless not `reduced`)."""
    gate_up = LinearSource(
        (f"{prefix}.gate_proj", f"{prefix}.up_proj"),
        ((width, hidden), (width, hidden)),
        bias,
        shard=functools.partial(_gate_up_shard, width, what),
    )
    down = LinearSource(
        (f"{prefix}.down_proj",),
        ((hidden, width),),
        bias,
        shard=functools.partial(_down_shard, width, what),
        reduced=reduced,
    )
    return gate_up, down


def _gate_up_shard(width: int, what: str, parallel: Parallel) -> Shard | None:
    channels = parallel.shard_range(width, what)  # this rank's
    return parallel.split_out(channels, channels)


def _down_shard(width: int, what: str, parallel: Parallel) -> Shard | None:
    return parallel.split_in(parallel.shard_range(width, what))


def gate_times_up(
    gate_up: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """gate_up (..., 2 * width), gate then up -> activation(gate) * up (..., width). SiLU on
    flat fp32 rows on the CPU runs as one compiled op (`kernels.silu_mul`: one pass, where
    torch's two ops write and read the gate's activations in between)."""
    if activation is F.silu and _compiled(gate_up):
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return activation(gate) * up


def _compiled(x: torch.Tensor) -> bool:
    """Whether `gate_times_up` runs as the compiled op: (T, 2 * width) fp32 on the CPU, its
    last dimension contiguous, no autograd, and the kernels in use here."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.requires_grad:
        return False
    return x.stride(-1) == 1 and kernels.in_use()

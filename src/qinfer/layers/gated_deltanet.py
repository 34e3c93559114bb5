"""The Gated DeltaNet layer (Qwen3.5, Qwen3-Next): linear attention over a fixed-size
per-sequence state, as transformers' `Qwen3_5GatedDeltaNet`.

    x (T, hidden)
      -> in_proj: q, k, v (the conv's C channels), z (gate of the output), b, a (per value head)
      -> causal depthwise conv1d over q/k/v (kernel K, SiLU), continuing the sequence's window
      -> q, k L2-normalised per head; beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias)
      -> the gated delta rule over the sequence's fp32 state (`qinfer.attention.deltanet`):
         chunked for prompts, recurrent for decode (on the CPU, where the kernels are in use,
         the compiled `kernels.gated_delta_chunked` / `gated_delta_recurrent`)
      -> RMSNorm over each value head, times silu(z) -> out_proj -> (T, hidden)

A step's sequences take their conv windows and states from the state pool's slots
(`qinfer.attention.state_pool`, `ForwardBatch.states`) and write them back. Sequences of
one length (a decode step, the reference path's rectangular rows) run together; a step of
mixed lengths runs its sequences one by one. A sequence that verifies proposed tokens
(speculative decoding) runs its own tokens, keeps the state in its checkpoint row, then
runs the proposals; both token by token (the recurrent form, as its decode steps would).
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F

from qinfer import kernels
from qinfer.attention.deltanet import (
    CHUNK_SIZE,
    causal_conv1d,
    chunked_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from qinfer.attention.state_pool import StepStates
from qinfer.core.errors import QinferError
from qinfer.core.model_config import ModelConfig
from qinfer.core.module import Module
from qinfer.core.parallel import Parallel
from qinfer.layers.norm import RMSNorm
from qinfer.linear import linear
from qinfer.weights.slots import LinearSlot, LinearSource, Placed, TensorSlot


class StoredTensor(Module, TensorSlot):
    """One checkpoint tensor a layer uses as it is stored (the conv's kernel, A_log,
    dt_bias), filled by `qinfer.weights.load`; `initial`: a fresh model's value."""

    def __init__(self, source: str, shape: tuple[int, ...], initial: float = 0.0) -> None:
        super().__init__()
        self.source, self.shape, self.initial = source, shape, initial
        self.register_buffer("value", torch.empty(shape, device="meta"))

    def fill(self, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != self.shape:
            raise ValueError(
                f"{self.source} has shape {tuple(tensor.shape)}, expected {self.shape}"
            )
        self.register_buffer("value", tensor)


class GatedDeltaNet(Module, Placed):
    """(T, hidden) -> (T, hidden) over the step's recurrent states.

    Slots: `in_proj` (the checkpoint's projections side by side, `DeltaNetConfig.projections`:
    Qwen3.5's four q/k/v, z, b, a, or Qwen3-Next's two grouped by key head), `out_proj`;
    tensors `conv` (C, 1, K), `A_log`, `dt_bias` (Hv,); the gated norm's weight (d_v,), not zero-centred.
    chunk_size: the tokens per chunk of the chunked form; None (the default): each form's
    measured best (`deltanet.CHUNK_SIZE` for torch's, `kernels.GATED_DELTA_CHUNK` compiled).
    """

    def __init__(self, layer_prefix: str, config: ModelConfig, *, layer: int) -> None:
        super().__init__()
        shapes = config.deltanet
        self.layer = layer
        self.shapes = shapes
        self.chunk_size: int | None = None
        self._taps_of: torch.Tensor | None = None  # the weight `_taps` was made from
        self._taps_cache: torch.Tensor | None = None
        H, Hv = config.hidden_size, shapes.num_value_heads
        prefix = f"{layer_prefix}.linear_attn"
        names = tuple(f"{prefix}.in_proj_{part}" for part in shapes.projections)
        # each projection's output rows, the split of the fused output each step
        self._outs = outs = [self._rows(part) for part in shapes.projections]
        self.in_proj = LinearSlot(LinearSource(names, tuple((out, H) for out in outs)))
        self.out_proj = LinearSlot(LinearSource((f"{prefix}.out_proj",), ((H, shapes.value_dim),)))
        self.conv = StoredTensor(
            f"{prefix}.conv1d.weight", (shapes.conv_dim, 1, shapes.conv_kernel)
        )
        self.A_log = StoredTensor(f"{prefix}.A_log", (Hv,))
        self.dt_bias = StoredTensor(f"{prefix}.dt_bias", (Hv,))
        dv = shapes.value_head_dim
        self.norm = RMSNorm(
            dv, torch.empty(dv, device="meta"), config.rms_norm_eps, source=f"{prefix}.norm.weight"
        )

    def place(self, parallel: Parallel, dtype: torch.dtype, device: torch.device) -> None:
        """One rank holds every head: the DeltaNet is not split under tensor parallelism."""
        if parallel.world_size > 1:
            raise QinferError(
                f"layer {self.layer} is linear attention (Gated DeltaNet), which tensor "
                f"parallelism does not split yet: run on one process, not {parallel.world_size}"
            )

    def forward(
        self, x: torch.Tensor, states: StepStates | None, query_starts: list[int]
    ) -> torch.Tensor:
        """x (T, hidden), the flat tokens of a step; states: the pool and each sequence's
        slot; query_starts: sequence s runs tokens query_starts[s]:query_starts[s + 1].
        Returns (T, hidden)."""
        if states is None:
            raise QinferError(
                f"layer {self.layer} is linear attention: the step needs its sequences' "
                "recurrent states (ForwardBatch.states)"
            )
        T = x.shape[0]
        qkv, z, b, a = self._project(x)  # (T, C), (T, Hv, dv), (T, Hv), (T, Hv)
        lengths = [end - start for start, end in pairwise(query_starts)]
        if len(set(lengths)) == 1 and not any(states.proposed or ()):
            # one length L: the S sequences as (S, L, ...) at once
            S, L = len(lengths), lengths[0]
            o = self._mix(qkv.view(S, L, -1), b.view(S, L, -1), a.view(S, L, -1), states)
        else:  # mixed lengths (a chunked prompt beside decodes), proposals: one at a time
            proposed = states.proposed or [0] * len(lengths)
            parts = []
            for s, (start, end) in enumerate(pairwise(query_starts)):
                one = StepStates(states.pool, states.slots[s : s + 1])
                k = proposed[s]
                # a verification: its own tokens, the state kept, then its proposals
                cuts = [start, end - k, end] if k else [start, end]
                for i, (first, last) in enumerate(pairwise(cuts)):
                    if i:
                        states.pool.keep(self.layer, one.slots)
                    part = slice(first, last)
                    parts.append(
                        self._mix(qkv[None, part], b[None, part], a[None, part], one, bool(k))
                    )
            o = torch.cat(parts, dim=1)
        # o (S, L, Hv, dv) fp32 -> (T, Hv, dv): RMSNorm over each head, gated by silu(z)
        o = self.norm(o.reshape(T, *z.shape[1:])) * F.silu(z.float())
        return linear(o.reshape(T, -1).to(x.dtype), self.out_proj)

    def _rows(self, part: str) -> int:
        """The output rows of projection `in_proj_<part>`."""
        s = self.shapes
        Hv = s.num_value_heads
        rows = {"qkv": s.conv_dim, "z": s.value_dim, "b": Hv, "a": Hv}
        return {**rows, "qkvz": s.conv_dim + s.value_dim, "ba": 2 * Hv}[part]

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (T, hidden) -> q/k/v (T, C) (q's heads, then k's, then v's: the conv's channel
        order), z (T, Hv, dv), b and a (T, Hv)."""
        s, T = self.shapes, x.shape[0]
        Hk, Hv, dk, dv = s.num_key_heads, s.num_value_heads, s.key_head_dim, s.value_head_dim
        r = Hv // Hk
        projected = linear(x, self.in_proj)
        parts = dict(
            zip(
                s.projections,
                projected.split(self._outs, -1),
                strict=True,
            )
        )
        if "qkvz" in parts:  # per key head its q (dk), k (dk), its r value heads' v, z (r dv)
            q, k, v, z = parts.pop("qkvz").reshape(T, Hk, -1).split([dk, dk, r * dv, r * dv], -1)
            parts["qkv"] = torch.cat([part.reshape(T, -1) for part in (q, k, v)], dim=-1)
            parts["z"] = z
        if "ba" in parts:  # per key head its r b's, then its r a's
            parts["b"], parts["a"] = parts.pop("ba").reshape(T, Hk, 2 * r).split([r, r], -1)
        b, a = (parts[name].reshape(T, Hv) for name in ("b", "a"))
        return parts["qkv"], parts["z"].reshape(T, Hv, dv), b, a

    def _mix(
        self,
        qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        states: StepStates,
        recurrent: bool = False,
    ) -> torch.Tensor:
        """S sequences of L tokens each: qkv (S, L, C), b, a (S, L, Hv); states: their S
        slots. Conv and delta rule from the slots' states, which are written back; the
        rule token by token for one token or when `recurrent` (a verification, computed
        as its decode steps would), else chunked. Returns the rule's output (S, L, Hv, dv)
        fp32."""
        s, slots = self.shapes, states.slots
        S, L, _ = qkv.shape
        conv_windows = states.pool.conv[self.layer]  # (slots, K - 1, C)
        matrices = states.pool.recurrent[self.layer]  # (slots, Hv, dk, dv) fp32
        compiled = self._compiled_mixer(qkv, conv_windows)
        if L == 1 and not recurrent and compiled:
            # a decode token: the whole mixer before the norm as one op (conv, norms,
            # gates and the rule: some 25 torch ops a layer otherwise)
            o = kernels.gated_delta_decode(
                qkv[:, 0],
                b[:, 0],
                a[:, 0],
                self._taps(),
                conv_windows,
                self.A_log.value,
                self.dt_bias.value,
                matrices,
                slots,
                s.num_key_heads,
            )
            return o[:, None]  # (S, 1, Hv, dv)
        if compiled:  # one pass, the windows updated where they lie
            mixed = kernels.causal_conv1d(qkv, self._taps(), conv_windows, slots)  # (S, L, C)
        else:
            # index_select, not [slots]: a plain copy of whole rows (advanced indexing
            # computes every element's offset: 1.8x the time for a 1 MiB state)
            mixed, window = causal_conv1d(
                qkv, self.conv.value.squeeze(1), conv_windows.index_select(0, slots)
            )  # (S, L, C), (S, K - 1, C)
            conv_windows.index_copy_(0, slots, window.to(conv_windows.dtype))
        q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        # (S, L, Hk, dk) each, normalised; value head h reads key head h // r
        q, k = (l2_normalize(x.reshape(S, L, s.num_key_heads, s.key_head_dim)) for x in (q, k))
        r = s.num_value_heads // s.num_key_heads
        if r > 1:
            q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
        v = v.reshape(S, L, s.num_value_heads, s.value_head_dim)
        beta = b.float().sigmoid()  # (S, L, Hv)
        g = -self.A_log.value.float().exp() * F.softplus(a.float() + self.dt_bias.value.float())
        chunked = L > 1 and not recurrent  # not decode, not a verification
        return gated_delta_rule(q, k, v, g, beta, matrices, slots, chunked, self.chunk_size)

    def _taps(self) -> torch.Tensor:
        """The conv's weight (C, 1, K) as taps (K, C), contiguous (the compiled conv and
        decode ops read each tap along the channels), made once from the weight the layer
        holds."""
        weight = self.conv.value
        if self._taps_of is not weight:
            self._taps_cache = weight.squeeze(1).t().contiguous()
            self._taps_of = weight
        return self._taps_cache

    def _compiled_mixer(self, qkv: torch.Tensor, windows: torch.Tensor) -> bool:
        """Whether the conv takes `kernels.causal_conv1d` and a decode token
        `kernels.gated_delta_decode`: CPU tensors without autograd where the kernels are in
        use, the activations, weights and windows fp32."""
        return (
            qkv.dtype == windows.dtype == self.conv.value.dtype == torch.float32
            and qkv.device.type == "cpu"
            and not qkv.requires_grad
            and kernels.in_use()
        )


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    chunked: bool,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The rule token by token or (`chunked`) `chunk_size` tokens at a time (None: the form's
    measured best) over the states in rows `slots` (S,) of `pool` (P, Hv, dk, dv) fp32,
    which it updates; the torch forms' other arguments, their output. The compiled ops (each
    sequence alone in its sums: the same bits in any batch) for CPU tensors without autograd
    where the kernels are in use read and write the rows in place; the torch forms
    (`QINFER_CPU_KERNELS=off` selects them) work on a gathered copy, written back (a
    sequence's state is 1 MiB at Qwen3.5-0.8B's shapes: the copies were most of a 32-sequence
    decode step's DeltaNet time)."""
    if pool.device.type == "cpu" and not q.requires_grad and kernels.in_use():
        v, beta = v.float(), beta.float()
        if not chunked:
            return kernels.gated_delta_recurrent(q, k, v, g, beta, pool, slots)
        size = kernels.GATED_DELTA_CHUNK if chunk_size is None else chunk_size
        return kernels.gated_delta_chunked(q, k, v, g, beta, pool, size, slots)
    # index_select, not [slots]: a plain copy of whole rows (advanced indexing computes
    # every element's offset: 1.8x the time for a 1 MiB state)
    state = pool.index_select(0, slots)  # the rule's to overwrite
    if not chunked:
        o, state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    else:
        o, state = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size or CHUNK_SIZE)
    pool.index_copy_(0, slots, state)
    return o

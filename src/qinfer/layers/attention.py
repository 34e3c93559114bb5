"""The seed's full grouped-query attention layer (tutorial 07), in PyTorch.

q/k/v projections -> reshape to heads -> QK-norm (Qwen3) -> RoPE -> the attention backend
(stores K/V, grouped scaled-dot-product attention with fp32 softmax) -> o projection.
With `Wiring.attention_output_gate` (Qwen3.5, Qwen3-Next) q_proj is twice as wide, each
head's D query rows followed by its D gate rows, and the attention's output is multiplied
by sigmoid(gate) before o_proj.

The layer runs on the flat tokens of a `ForwardBatch`; the seed's own call on (B, L, hidden)
rows and one contiguous cache is that same forward through the reference backend.

Under tensor parallelism (`qinfer.core.parallel`) a rank holds Hq / N query heads and the KV heads
they read: q/k/v are column-parallel (the rank's heads), QK-norm, RoPE and attention run on
those heads alone, and o_proj is row-parallel (its call all-reduces the ranks' sums).
"""

from __future__ import annotations

import functools

import torch

from qinfer.attention.reference import Cache, ReferenceAttention
from qinfer.attention.sdpa import Mask, sdpa_for
from qinfer.core.features import Features
from qinfer.core.forward_batch import AdapterRows, Rotations, StepAttention, row_positions
from qinfer.core.model_config import ModelConfig
from qinfer.core.module import Module
from qinfer.core.parallel import SINGLE, Parallel, Shard
from qinfer.layers.norm import head_norms, rms_norm
from qinfer.layers.rope import layer_rope
from qinfer.linear import linear
from qinfer.weights.slots import LinearSlot, LinearSource, Placed


class Attention(Module, Placed):
    """The seed's attention layer: (T, hidden) -> (T, hidden) in a model's forward,
    (B, L, hidden) -> (B, L, hidden) as the seed calls it.

    Built from the config with empty slots (`wqkv`, `wo`; `qkv_sizes`, `num_heads` and
    `num_kv_heads` are this rank's, set by `place`): `qinfer.weights.load.load(attention,
    weights)` fills one layer on its own, as loading a model fills all of them.
    """

    def __init__(
        self, layer_prefix: str, config: ModelConfig, features: Features, *, layer: int
    ) -> None:
        """layer: the layer's index, which picks its RoPE settings (`config.rope_for`) and
        names its K/V to the attention backend; its RoPE may be none (`NoRoPE`)."""
        super().__init__()
        self.layer = layer
        self.hidden_size = H = config.hidden_size
        self.head_dim = D = config.head_dim
        self.features = features
        self.heads = (config.num_attention_heads, config.num_key_value_heads)
        self.rope_settings = (config.max_position_embeddings, config.rope_for(layer))
        # Rows of q_proj per query head: its query, then (gated attention) its gate.
        self.gated = config.wiring.attention_output_gate
        self.q_rows = 2 * D if self.gated else D
        # The scale factor for attention scores: 1/sqrt(head_dim), or the family's
        # (Gemma: 1/sqrt(query_pre_attn_scalar)).
        self.scale = config.attention_scale
        wiring = config.wiring

        # q, k and v loaded as one projection (rows stacked): one kernel call per step.
        # Under tensor parallelism each is read by this rank's heads (`_head_rows`).
        q_out, kv_out = config.num_attention_heads * D, config.num_key_value_heads * D
        prefix = f"{layer_prefix}.self_attn"
        self.wqkv = LinearSlot(
            LinearSource(
                (f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"),
                ((config.num_attention_heads * self.q_rows, H), (kv_out, H), (kv_out, H)),
                wiring.qkv_bias,
                shard=functools.partial(_qkv_shard, *self.heads, D, self.q_rows),
            )
        )
        self.wo = LinearSlot(
            LinearSource(
                (f"{prefix}.o_proj",),
                ((H, q_out),),
                wiring.o_bias,
                shard=functools.partial(_o_shard, *self.heads, D),
            )
        )
        # Per-head QK-norm (Qwen3, Gemma 3): RMSNorm over head_dim, on q and k, before RoPE.
        self.q_norm = self.k_norm = None
        if wiring.qk_norm:
            self.q_norm = rms_norm(f"{prefix}.q_norm.weight", D, config)
            self.k_norm = rms_norm(f"{prefix}.k_norm.weight", D, config)
        self.place(SINGLE, torch.float32, torch.device("cpu"))

    def place(self, parallel: Parallel, dtype: torch.dtype, device: torch.device) -> None:
        """This rank's heads: Hq / N query heads and their KV heads (Hkv / N, or one shared
        with other ranks when Hkv < N); RoPE frequencies on `device`."""
        q_rows, kv_rows = _head_rows(*self.heads, self.head_dim, self.q_rows, parallel)
        self.qkv_sizes = [len(q_rows), len(kv_rows), len(kv_rows)]
        self.num_heads = len(q_rows) // self.q_rows
        self.num_kv_heads = len(kv_rows) // self.head_dim
        # RoPE frequencies are shared by every layer with the same settings (layers/rope.py);
        # a layer's settings may be its own (Gemma 3's sliding layers: `config.rope_for`),
        # none (SmolLM3's NoPE layers: q and k pass through), or M-RoPE's (Qwen-VL: three
        # positions per token): `layer_rope` picks the kind, the calls below are the same.
        context, rope = self.rope_settings
        self.rope = layer_rope(self.head_dim, context, rope, device)

    def forward(
        self,
        x: torch.Tensor,
        positions: int | torch.Tensor,
        attention: StepAttention | Cache,
        mask: Mask = None,
        rotations: Rotations | None = None,
        adapters: AdapterRows | None = None,
    ) -> torch.Tensor:
        """x: (T, hidden), the flat tokens of a `ForwardBatch`; positions: (T,), or (3, T)
        under M-RoPE (`ForwardBatch.positions`);
        attention: the step's backend, which stores K/V and attends; rotations: the
        batch's cos/sin of those positions, shared by its layers (None: computed here);
        adapters: the batch's LoRA rows (`ForwardBatch.adapters`). Returns (T, hidden).

        The seed's call, x (B, L, hidden) -> (B, L, hidden), runs the same layer over one
        contiguous cache through the reference backend (`qinfer.attention.reference`):
        positions are then offsets (int or (B,): each row's first position; or (B, L)),
        attention is a `qinfer.attention.kv_cache` cache and mask as in
        `scaled_dot_product_attention_grouped`, handed to the cache to complete."""
        if x.dim() == 3:  # the seed's call: the flat forward over its rows
            B, L, H = x.shape
            flat = row_positions(positions, B, L, x.device).reshape(B * L)
            backend = ReferenceAttention(
                {self.layer: attention}, B, L, mask, sdpa_for(self.features)
            )
            return self.forward(x.reshape(B * L, H), flat, backend).view(B, L, H)
        T = x.shape[0]

        # Step 1: project to Q, K, V (one fused projection), viewed as heads:
        # (T, (Hq + 2 Hkv) * D) -> (T, Hq + 2 Hkv, D), q's heads, then k's, then v's. Hq and
        # Hkv are this rank's heads (Hq / N and Hkv / N, or 1, under tensor parallelism).
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        gate = None
        if self.gated:  # q's Hq heads are (query, gate) pairs: (T, 2 Hq + 2 Hkv, D)
            heads = linear(x, self.wqkv, adapters).reshape(T, 2 * Hq + 2 * Hkv, D)
            pairs = heads[:, : 2 * Hq].view(T, Hq, 2, D)  # (T, Hq, 2, D)
            gate = pairs[:, :, 1]  # (T, Hq, D)
            # the query heads beside k's, as the ungated layer has them: (T, Hq + Hkv, D)
            projection_qk = torch.cat((pairs[:, :, 0], heads[:, 2 * Hq : 2 * Hq + Hkv]), dim=1)
            projection_v = heads[:, 2 * Hq + Hkv :]
        else:
            heads = linear(x, self.wqkv, adapters).reshape(T, Hq + 2 * Hkv, D)
            projection_qk, projection_v = heads[:, : Hq + Hkv], heads[:, Hq + Hkv :]

        # Step 2: per-head QK-norm, within each head, before RoPE: q_norm on q's heads and
        # k_norm on k's, in one pass over both.
        if self.q_norm is not None:
            projection_qk = head_norms(projection_qk, self.q_norm, self.k_norm, Hq)

        # Step 3: RoPE on Q and K (not V). A token's q and k heads share its position, so
        # one rotation of the (T, Hq + Hkv, D) heads serves both (half the ops of rotating
        # each, which a decode step feels); cos and sin, (T, 1, D/2) each, are computed
        # once per step for every layer (`ForwardBatch.rotations`).
        if rotations is None:
            cos, sin = self.rope.rotation(positions, projection_qk.dtype)
        else:
            cos, sin = rotations.of(self.rope, projection_qk.dtype)
        projection_qk = self.rope.apply(projection_qk, cos, sin)
        projection_q, projection_k = projection_qk[:, :Hq], projection_qk[:, Hq:]

        # Steps 4-6: the backend stores this step's K/V and attends each query over its own
        # sequence's visible history (padding, sliding window, causal). The reference
        # backend is the seed's two calls on (B, H, L, D) views of these tensors:
        #     keys, values, _, mask = cache.update_and_fetch(k, v, mask_length=L, mask=mask)
        #     x = scaled_dot_product_attention_grouped(q, keys, values, scale, mask)
        # a paged backend attends where the K/V of every sequence live in its block pool.
        x = attention.attend(self.layer, projection_q, projection_k, projection_v, self.scale)
        if gate is not None:  # the output gate, per channel: (T, Hq, D) * sigmoid((T, Hq, D))
            x = x * torch.sigmoid(gate).to(x.dtype)

        # Step 7: (T, Hq, D) -> (T, Hq * D) -> output projection -> (T, hidden).
        # Under tensor parallelism o_proj is row-parallel: the rank's heads give a partial
        # sum, and its call all-reduces the ranks' sums (the layer's one collective).
        return linear(x.reshape(T, Hq * D), self.wo, adapters)


def _head_rows(
    heads: int, kv_heads: int, head_dim: int, q_rows: int, parallel: Parallel
) -> tuple[range, range]:
    """This rank's rows of q's projection (q_rows per head: head_dim, or twice that with
    the head's gate) and of k's (and v's): each KV head is head_dim consecutive rows."""
    q_heads, kv = parallel.attention_heads(heads, kv_heads)
    D = head_dim
    return range(q_heads.start * q_rows, q_heads.stop * q_rows), range(kv.start * D, kv.stop * D)


def _qkv_shard(
    heads: int, kv_heads: int, head_dim: int, q_rows: int, parallel: Parallel
) -> Shard | None:
    """Column-parallel q/k/v: this rank's query heads (with their gates) and the KV heads
    they read."""
    q, kv = _head_rows(heads, kv_heads, head_dim, q_rows, parallel)
    return parallel.split_out(q, kv, kv)


def _o_shard(heads: int, kv_heads: int, head_dim: int, parallel: Parallel) -> Shard | None:
    """Row-parallel o_proj: the columns of this rank's query heads (head_dim each)."""
    return parallel.split_in(_head_rows(heads, kv_heads, head_dim, head_dim, parallel)[0])

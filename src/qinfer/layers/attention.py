"""The seed's full grouped-query attention layer (tutorial 07), in PyTorch.

q/k/v projections -> reshape to heads -> QK-norm (Qwen3) -> RoPE -> the attention backend
(stores K/V, grouped scaled-dot-product attention with fp32 softmax) -> o projection.

The layer runs on the flat tokens of a `ForwardBatch` (`forward`); the seed's own call on
(B, L, hidden) rows and one contiguous cache (`__call__`) is that same forward through the
reference backend.

Under tensor parallelism (`qinfer.parallel`) a rank holds Hq / N query heads and the KV heads
they read: q/k/v are column-parallel (the rank's heads), QK-norm, RoPE and attention run on
those heads alone, and o_proj is row-parallel (its call all-reduces the ranks' sums).
"""

from __future__ import annotations

import torch

from qinfer.attention.backend import AttentionBackend, sdpa_for
from qinfer.attention.reference import Cache, ReferenceAttention
from qinfer.attention.sdpa import Mask
from qinfer.config import ModelConfig
from qinfer.features import Features
from qinfer.layers.norm import load_rms_norm
from qinfer.layers.rope import NoRoPE, RoPE, row_positions
from qinfer.linear import linear
from qinfer.parallel import SINGLE, Parallel
from qinfer.weights.base import Weights


class Attention:
    """The seed's attention layer: (B, L, hidden) -> (B, L, hidden) as the seed calls it,
    (T, hidden) -> (T, hidden) in a model's forward.

    num_heads and num_kv_heads are this rank's (all of them in a single process).
    """

    def __init__(
        self,
        layer_prefix: str,
        config: ModelConfig,
        weights: Weights,
        features: Features,
        parallel: Parallel = SINGLE,
        *,
        layer: int,
    ):
        """layer: the layer's index, which picks its RoPE settings (`config.rope_for`) and
        names its K/V to the attention backend; its RoPE may be none (`NoRoPE`)."""
        self.layer = layer
        self.hidden_size = config.hidden_size
        self.head_dim = D = config.head_dim
        self.features = features
        # This rank's heads: Hq / N query heads and their KV heads (Hkv / N, or one shared
        # with other ranks when Hkv < N).
        q_heads, kv_heads = parallel.attention_heads(
            config.num_attention_heads, config.num_key_value_heads
        )
        self.num_heads, self.num_kv_heads = len(q_heads), len(kv_heads)

        # The scale factor for attention scores: 1/sqrt(head_dim), or the family's
        # (Gemma: 1/sqrt(query_pre_attn_scalar)).
        self.scale = config.attention_scale
        wiring = config.wiring

        # Each head is D consecutive rows of its projection (columns of o_proj).
        q_rows = range(q_heads.start * D, q_heads.stop * D)
        kv_rows = range(kv_heads.start * D, kv_heads.stop * D)
        q_out = config.num_attention_heads * D
        kv_out = config.num_key_value_heads * D
        prefix = f"{layer_prefix}.self_attn"
        # q, k and v loaded as one projection (rows stacked): one kernel call per step.
        self.qkv_sizes = [len(q_rows), len(kv_rows), len(kv_rows)]
        self.wqkv = weights.linear(
            [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"],
            [(q_out, self.hidden_size), (kv_out, self.hidden_size), (kv_out, self.hidden_size)],
            wiring.qkv_bias,
            shard=parallel.split_out(q_rows, kv_rows, kv_rows),
        )
        self.wo = weights.linear(
            f"{prefix}.o_proj",
            (self.hidden_size, q_out),
            wiring.o_bias,
            shard=parallel.split_in(q_rows),
        )

        # RoPE frequencies are shared by every layer with the same settings (layers/rope.py);
        # a layer's settings may be its own (Gemma 3's sliding layers: `config.rope_for`),
        # or none (SmolLM3's NoPE layers: q and k pass through).
        rope = config.rope_for(layer)
        self.rope = (
            NoRoPE()
            if rope is None
            else RoPE(self.head_dim, config.max_position_embeddings, rope, weights.device)
        )

        # Per-head QK-norm (Qwen3, Gemma 3): RMSNorm over head_dim, on q and k, before RoPE.
        self.q_norm = self.k_norm = None
        if wiring.qk_norm:
            self.q_norm = load_rms_norm(weights, f"{prefix}.q_norm.weight", D, config)
            self.k_norm = load_rms_norm(weights, f"{prefix}.k_norm.weight", D, config)

    def __call__(
        self, x: torch.Tensor, offsets: int | torch.Tensor, cache: Cache, mask: Mask = None
    ) -> torch.Tensor:
        """The seed's call: x (B, L, hidden) -> (B, L, hidden) over this layer's contiguous
        cache, through the reference backend (`qinfer.attention.reference`).

        offsets: position of each row's first token (int or (B,)), or of every token ((B, L));
        cache: a `qinfer.kv_cache` cache; mask as in `scaled_dot_product_attention_grouped`,
        handed to the cache to complete."""
        B, L, H = x.shape
        positions = row_positions(offsets, B, L, x.device).reshape(B * L)
        attention = ReferenceAttention({self.layer: cache}, B, L, mask, sdpa_for(self.features))
        return self.forward(x.reshape(B * L, H), positions, attention).view(B, L, H)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        """x: (T, hidden), the flat tokens of a `ForwardBatch`; positions: (T,);
        attention: the step's backend, which stores K/V and attends. Returns (T, hidden)."""
        T = x.shape[0]

        # Step 1: project to Q, K, V (one fused projection, split into its three parts).
        # (T, (Hq + 2 Hkv) * D) -> 3 x (T, H * D) -> (T, H, D); Hq and Hkv are this rank's
        # heads (Hq / N and Hkv / N, or 1, under tensor parallelism).
        projection_q, projection_k, projection_v = linear(x, self.wqkv).split(self.qkv_sizes, -1)
        projection_q = projection_q.reshape(T, self.num_heads, self.head_dim)
        projection_k = projection_k.reshape(T, self.num_kv_heads, self.head_dim)
        projection_v = projection_v.reshape(T, self.num_kv_heads, self.head_dim)

        # Step 2: per-head QK-norm, within each head, before RoPE.
        if self.q_norm is not None:
            projection_q = self.q_norm(projection_q)
            projection_k = self.k_norm(projection_k)

        # Step 3: RoPE on Q and K (not V), both rotated by one lookup of cos and sin
        # ((T, 1, D/2) each, shared by every layer of the step).
        cos, sin = self.rope.rotation(positions, projection_q.dtype)
        projection_q = self.rope.apply(projection_q, cos, sin)
        projection_k = self.rope.apply(projection_k, cos, sin)

        # Steps 4-6: the backend stores this step's K/V and attends each query over its own
        # sequence's visible history (padding, sliding window, causal). The reference
        # backend is the seed's two calls on (B, H, L, D) views of these tensors:
        #     keys, values, _, mask = cache.update_and_fetch(k, v, mask_length=L, mask=mask)
        #     x = scaled_dot_product_attention_grouped(q, keys, values, scale, mask)
        # a paged backend attends where the K/V of every sequence live in its block pool.
        x = attention.attend(self.layer, projection_q, projection_k, projection_v, self.scale)

        # Step 7: (T, Hq, D) -> (T, Hq * D) -> output projection -> (T, hidden).
        # Under tensor parallelism o_proj is row-parallel: the rank's heads give a partial
        # sum, and its call all-reduces the ranks' sums (the layer's one collective).
        return linear(x.reshape(T, self.num_heads * self.head_dim), self.wo)

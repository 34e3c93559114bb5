"""The decoder-only transformer: embed -> N x Block(attention, MLP) -> norm -> lm_head.

One class serves every family of `qinfer.models`; their differences (QK-norm, biases, tied
heads, RoPE scaling, per-layer and partial RoPE, layers without RoPE, sliding windows,
experts, Gemma's scaled embeddings, (1 + w) and sandwich norms, GeGLU, logit softcapping)
are the config's fields and `Wiring`, set by each family's file, and which tensors the
checkpoint holds.

A model is built from its config, then loaded (`qinfer.weights.load`); every layer is a
`torch.nn.Module` (`named_modules()`, forward hooks, `state_dict()`).

Under tensor parallelism (`qinfer.core.parallel`) every rank builds this same model, loads its
part of the weights and runs the same forward; the collectives sit in the row- and
vocab-parallel Linears (`qinfer.linear.parallel`), so the code below reads the same at
any world size.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from qinfer.attention.kv_cache import KVCache, RotatingKVCache, StepMasks
from qinfer.attention.kv_quant import KVFormat, kv_format
from qinfer.attention.reference import ReferenceAttention
from qinfer.attention.sdpa import Mask, sdpa_for
from qinfer.attention.state_pool import StatePool, StepStates
from qinfer.core.errors import QinferError
from qinfer.core.features import Features
from qinfer.core.forward_batch import ForwardBatch
from qinfer.core.model_config import ModelConfig
from qinfer.core.module import Module
from qinfer.core.parallel import Parallel, Shard
from qinfer.layers.attention import Attention
from qinfer.layers.gated_deltanet import GatedDeltaNet
from qinfer.layers.mlp import MLP
from qinfer.layers.moe import SparseMoE
from qinfer.layers.norm import RMSNorm, rms_norm
from qinfer.linear import Linear
from qinfer.linear.grouped import GroupedLinear
from qinfer.weights.load import init_random
from qinfer.weights.slots import LinearSlot, LinearSource, Placed


class Block(Module):
    """One decoder layer: pre-norm attention and pre-norm MLP, each with a residual. The
    attention is the seed's (`self_attn`), or a Gated DeltaNet (`linear_attn`) where the
    config's layer_types says linear_attention (Qwen3.5, Qwen3-Next).

    The residual stream is fp32 whatever the compute dtype: the norms before attention and
    the MLP read it and write the compute dtype their matmuls take, and the outputs are
    added to it in fp32 (`set_dtype`), as llama.cpp keeps its activations.

    layer: the layer's index; its MLP is a mixture of experts where the config says so.
    prefix: its tensors' prefix in the checkpoint (default `model.layers.<layer>`; the MTP
    head's layer is `mtp.layers.0`, `qinfer.model.mtp_head`).
    With `config.wiring.sandwich_norms` (Gemma) the outputs of attention and MLP are normed too,
    before their residual add: four norms per block, named as in the checkpoint
    (input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
    post_feedforward_layernorm). Without, the norm before the MLP is the checkpoint's
    `post_attention_layernorm` (Llama's name for it).
    """

    def __init__(
        self, layer: int, config: ModelConfig, features: Features, prefix: str | None = None
    ):
        super().__init__()
        prefix, H = prefix or f"model.layers.{layer}", config.hidden_size

        def norm(name: str) -> RMSNorm:
            return rms_norm(f"{prefix}.{name}.weight", H, config)

        self.attention_norm = norm("input_layernorm")
        self.self_attn = self.linear_attn = None
        if config.linear(layer):
            self.linear_attn = GatedDeltaNet(prefix, config, layer=layer)
        else:
            self.self_attn = Attention(prefix, config, features, layer=layer)
        self.attention_output_norm = self.mlp_output_norm = None
        if config.wiring.sandwich_norms:
            self.attention_output_norm = norm("post_attention_layernorm")
            self.mlp_norm = norm("pre_feedforward_layernorm")
            self.mlp_output_norm = norm("post_feedforward_layernorm")
        else:
            self.mlp_norm = norm("post_attention_layernorm")
        self.mlp = SparseMoE(prefix, config) if config.sparse(layer) else MLP(prefix, config)

    def set_dtype(self, dtype: torch.dtype) -> None:
        """Compute in `dtype`: the pre-norms write it; the sandwich norms, whose outputs
        join the residual stream, write fp32."""
        self.attention_norm.out_dtype = self.mlp_norm.out_dtype = dtype
        for norm in (self.attention_output_norm, self.mlp_output_norm):
            if norm is not None:
                norm.out_dtype = torch.float32

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x (T, hidden) fp32 -> (T, hidden) fp32: the flat tokens of `batch`. The residual
        stream x is updated in place and returned (the adds write into it)."""
        if self.linear_attn is not None:
            attended = self.linear_attn(self.attention_norm(x), batch.states, batch.query_starts)
        else:
            attended = self.self_attn(
                self.attention_norm(x),
                batch.positions,
                batch.attention,
                rotations=batch.rotations,
                adapters=batch.adapters,
            )
        # x += the attention's output, then the MLP's norm of x: one op (`RMSNorm.add`)
        mlp_in = self.mlp_norm.add(x, _normed(self.attention_output_norm, attended))
        x += _normed(self.mlp_output_norm, self.mlp(mlp_in, batch.adapters))
        return x

    def norms(self) -> list[RMSNorm]:
        """Every norm of the block, QK-norms included."""
        found = [self.attention_norm, self.attention_output_norm, self.mlp_norm]
        found += [self.mlp_output_norm]
        if self.self_attn is not None:
            found += [self.self_attn.q_norm, self.self_attn.k_norm]
        else:
            found += [self.linear_attn.norm]
        return [norm for norm in found if norm is not None]


def _split_vocab(vocab_size: int, parallel: Parallel) -> Shard | None:
    """Vocab-parallel embedding and lm_head: this rank's rows of the vocabulary."""
    return parallel.split_vocab(vocab_size)


def _normed(norm: RMSNorm | None, x: torch.Tensor) -> torch.Tensor:
    """x through `norm`, or x itself where the block has no such norm."""
    return x if norm is None else norm(x)


class Transformer(Module, Placed):
    """A decoder-only model. Call it on token ids (B, L) to get fp32 logits (B, L, vocab).

    `Transformer(config, features)` builds it from the config alone: every projection an
    empty slot and every norm a placeholder on the meta device (`qinfer.weights.slots`),
    nothing read or allocated. `qinfer.weights.load.load(model, weights, parallel,
    quantize)` fills it from a checkpoint (`load_model` does both), `init_random` with
    random weights (`Transformer.random`).

    Under tensor parallelism (the `parallel` given to `load`) each rank holds its part of
    the weights and every rank calls the model with the same inputs, in the same order;
    each gets the whole logits.
    """

    def __init__(self, config: ModelConfig, features: Features | None = None):
        super().__init__()
        self.config = config
        self.features = features or Features()
        # Until loaded: nothing is held anywhere, and a call says so (`slots.not_loaded`).
        self.parallel, self.dtype, self.device = Parallel(), torch.float32, torch.device("meta")
        # what kv_cache_dtype "auto" stores, where not the compute dtype (`loading.load_model`)
        self.kv_auto_dtype: torch.dtype | None = None
        self.embedding_scale = None
        V, H = config.vocab_size, config.hidden_size
        # The embedding table is a Linear too (read by rows): quantized like the rest, split
        # by vocabulary rows under tensor parallelism.
        vocab = functools.partial(_split_vocab, V)
        self.embed_tokens = LinearSlot(
            LinearSource(("model.embed_tokens",), ((V, H),), rows=True, shard=vocab)
        )
        self.layers = nn.ModuleList(
            Block(i, config, self.features) for i in range(config.num_hidden_layers)
        )
        self.norm = rms_norm("model.norm.weight", H, config)
        # Untied per config means the checkpoint must hold its own lm_head: tying it to the
        # embeddings instead would be silently wrong output.
        # A tied head is the embedding's slot itself: loaded (and quantized) once.
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else LinearSlot(LinearSource(("lm_head",), ((V, H),), shard=vocab))
        )
        # the checkpoint's multi-token-prediction head, where loaded (`load_model(mtp=True)`,
        # `qinfer.model.mtp_head`): a speculative draft
        self.mtp = None

    @classmethod
    def random(
        cls,
        config: ModelConfig,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        features: Features | None = None,
    ) -> Transformer:
        """A model of `config` with random weights (`qinfer.weights.load.init_random`):
        no checkpoint needed (tests, drafts)."""
        return init_random(cls(config, features), seed, dtype, device)

    def place(self, parallel: Parallel, dtype: torch.dtype, device: torch.device) -> None:
        """Refuse a world size that does not split the model evenly, before anything loads;
        then take on the rank, dtype and device."""
        config = self.config
        parallel.check_model(
            config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
        )
        if config.moe is not None:
            parallel.shard_range(config.moe.moe_intermediate_size, "expert FFN channels")
            if config.moe.shared_expert_intermediate_size:
                parallel.shard_range(
                    config.moe.shared_expert_intermediate_size, "shared expert FFN channels"
                )
        self.parallel, self.dtype, self.device = parallel, dtype, device
        for block in self.layers:
            block.set_dtype(dtype)
        self.norm.out_dtype = torch.float32  # the head takes fp32 (`Linear.logits`)
        # Gemma scales the embeddings by sqrt(hidden), in the fp32 residual stream (where
        # transformers scales in the compute dtype: in bf16, sqrt(640) = 25.3 is 25.25).
        scale = config.wiring.embedding_scale
        self.embedding_scale = (
            None if scale is None else torch.tensor(scale, dtype=torch.float32, device=device)
        )

    def linears(self) -> dict[str, Linear | GroupedLinear]:
        """Every projection by name (a mixture of experts' projections as one grouped Linear
        each), as `named_modules` names it; a tied head appears once, as `embed_tokens`."""
        found: dict[str, Linear | GroupedLinear] = {}

        def visit(module: nn.Module, prefix: str) -> None:
            for name, child in module.named_children():  # a tied head: once
                if isinstance(child, Linear | GroupedLinear):
                    found[prefix + name] = child  # its own parts are not listed
                else:
                    visit(child, f"{prefix}{name}.")

        visit(self, "")
        return found

    def make_cache(
        self,
        batch_size: int = 1,
        left_padding: torch.Tensor | list[int] | None = None,
        max_length: int | None = None,
    ) -> list[KVCache | RotatingKVCache | StatePool]:
        """One cache per layer: contiguous for full attention, a ring for sliding windows,
        storing K/V as `features.kv_cache_dtype` says; for linear attention (Gated
        DeltaNet) layers, one `StatePool` they share, slot b holding row b's state.

        left_padding: (batch_size,) pad tokens at the start of each row of a batch (not
            with linear-attention layers, whose state would take in the padding).
        max_length: positions the cache may hold (default: the model's context).
        """
        limit = min(
            max_length or self.config.max_position_embeddings, self.config.max_position_embeddings
        )
        step_masks = StepMasks()  # every layer of one window builds the same mask each step
        fmt = self.kv_format
        states = None
        if self.config.deltanet is not None:
            if left_padding is not None:
                raise QinferError(
                    "left_padding: a model with linear-attention layers runs rows of one "
                    "length (its recurrent state would take in the padding)"
                )
            states = StatePool(self.config, batch_size, self.dtype, self.device)
        caches: list[KVCache | RotatingKVCache | StatePool] = []
        for layer in range(self.config.num_hidden_layers):
            window = self.config.window(layer)
            if self.config.linear(layer):
                caches.append(states)
            elif window is None:
                caches.append(KVCache(batch_size, limit, left_padding, step_masks, fmt))
            else:
                caches.append(
                    RotatingKVCache(window, batch_size, limit, left_padding, step_masks, fmt)
                )
        return caches

    @property
    def kv_format(self) -> KVFormat:
        """How this model's caches store K/V (`features.kv_cache_dtype`; "auto" is
        `kv_auto_dtype`, else the compute dtype)."""
        return kv_format(self.features.kv_cache_dtype, self.kv_auto_dtype or self.dtype)

    @torch.inference_mode()
    def __call__(
        self,
        tokens: torch.Tensor,
        offsets: int | torch.Tensor | None = None,
        cache: list | None = None,
        mask: Mask = None,
        last_only: bool = False,
        adapters: list[int | None] | None = None,
    ) -> torch.Tensor:
        """tokens (B, L) -> logits (B, L, vocab) in fp32 ((B, 1, vocab) with last_only).

        offsets: position of each row's first token (int or (B,)), or of every token
            ((B, L)); by default where the cache left off (0 without a cache).
        cache: from `make_cache`; without one, the call sees only these tokens.
        mask: "causal" (the default) or a boolean (B, 1, L, S) tensor.
        adapters: row b's LoRA adapter slot (`qinfer.lora.Adapters`; None: the base model).

        Checks its inputs (ids inside the vocabulary, positions inside the context: host
        syncs), then runs `run_rows`. This is the model's public call, in place of
        `nn.Module.__call__`: `forward(batch)` is the engine's (hooks on the layers fire
        either way).
        """
        tokens = self._check_tokens(tokens)
        B, L = tokens.shape
        if cache is None:
            cache = self.make_cache(B, max_length=L)
        elif len(cache) != len(self.layers):
            raise QinferError(f"cache has {len(cache)} layers, the model has {len(self.layers)}")
        if offsets is None:  # where the first attention layer's cache left off
            offsets = next(c for c in cache if not isinstance(c, StatePool)).offsets
        self._check_positions(offsets, L)
        tokens = tokens.to(self.device, torch.long)
        return self.run_rows(tokens, offsets, cache, mask, last_only, adapters)

    @torch.inference_mode()
    def run_rows(
        self,
        tokens: torch.Tensor,
        offsets: int | torch.Tensor,
        cache: list,
        mask: Mask = None,
        last_only: bool = False,
        adapters: list[int | None] | None = None,
    ) -> torch.Tensor:
        """`__call__` without its checks and without host syncs, for callers that built the
        inputs themselves (generate's decode loop, benchmarks): B rows of L tokens through
        the reference attention backend over contiguous caches.

        tokens (B, L) long on the model's device; offsets, cache and adapters as in
        `__call__`.
        Returns fp32 logits (B, L, vocab), or (B, 1, vocab) with last_only.
        """
        batch = self.rows_batch(tokens, offsets, cache, mask, last_only, adapters)
        logits = self.compute_logits(batch.logits_rows(self.forward(batch)))
        return logits.view(tokens.shape[0], -1, logits.shape[-1])

    def rows_batch(
        self,
        tokens: torch.Tensor,
        offsets: int | torch.Tensor,
        cache: list,
        mask: Mask = None,
        last_only: bool = False,
        adapters: list[int | None] | None = None,
    ) -> ForwardBatch:
        """The `ForwardBatch` of B rows of L tokens (B, L) over contiguous caches from
        `make_cache`: the reference attention backend, and row b's recurrent state in slot b
        of the caches' `StatePool` (linear-attention layers)."""
        B, L = tokens.shape
        mask = "causal" if mask is None else mask
        attention = ReferenceAttention(cache, B, L, mask, sdpa_for(self.features))
        pool = next((c for c in cache if isinstance(c, StatePool)), None)
        states = None if pool is None else StepStates(pool, torch.arange(B, device=self.device))
        return ForwardBatch.from_rows(tokens, offsets, attention, last_only, states, adapters)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """One forward of a `ForwardBatch` -> the final residual stream (T, hidden) fp32,
        before the final norm (`compute_logits` applies it to the rows it is given). No checks and
        no host syncs: the batch's builder checked the ids and positions.

        With `batch.images` (a vision-language model's step), the images' embeddings take
        the place of their tokens' embedded rows, and DeepStack feature i joins those rows
        after layer i, as transformers' Qwen2.5-VL and Qwen3-VL do."""
        h = self.embed(batch.token_ids)  # (T, hidden)
        images, deepstack = batch.images, ()
        if images is not None:
            if self.config.image_token_id is None:
                raise QinferError(
                    f"the batch holds {images.rows.shape[0]} image tokens' embeddings, but "
                    f"model_type {self.config.model_type!r} is a text-only model"
                )
            h = h.index_copy(0, images.rows, images.embeddings)  # (N, hidden) into (T, hidden)
            deepstack = images.deepstack
        for i, layer in enumerate(self.layers):
            h = layer(h, batch)
            if i < len(deepstack):
                h = h.index_add(0, images.rows, deepstack[i])
        return h

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (any shape P) -> the residual stream's input (*P, hidden), fp32."""
        h = self.embed_tokens.rows(tokens).float()
        return h if self.embedding_scale is None else h * self.embedding_scale

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """A residual (*P, hidden) -> fp32 logits (*P, vocab): final norm, lm_head and the
        config's softcap (also the logit lens of an inner layer's residual). The head
        multiplies in the compute dtype; the highest logits of each row are fp32's
        (`qinfer.linear.logits`)."""
        normed = self.norm(h)  # (*P, hidden) fp32
        logits = self.lm_head.logits(normed.view(-1, normed.shape[-1]), self.dtype)
        logits = logits.view(*normed.shape[:-1], logits.shape[-1])
        cap = self.config.wiring.final_logit_softcapping
        if cap is not None:  # squashed smoothly into (-cap, cap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _check_positions(self, offsets: int | torch.Tensor, L: int) -> None:
        # RoPE would rotate any position, and the first layers run before a cache could
        # refuse the step: positions past the model's context are refused here, up front.
        if isinstance(offsets, int):
            last = offsets + L - 1
        else:  # (B,) first positions, or (B, L) positions of every token
            last = int(offsets.max()) + (L - 1 if offsets.dim() == 1 else 0)
        context = self.config.max_position_embeddings
        if last >= context:
            raise QinferError(
                f"position {last} is past the model's context of {context} positions "
                "(max_position_embeddings)"
            )

    def _check_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise QinferError("tokens must be a (batch, length) tensor of token ids")
        if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise QinferError(f"tokens must be integer ids, got dtype {tokens.dtype}")
        if tokens.numel() == 0:
            raise QinferError("tokens is empty: give at least one token per row")
        # Checked where the ids are, before the copy: ids built on the host then cost no
        # device round trip.
        low, high = (int(end) for end in torch.aminmax(tokens))
        if low < 0 or high >= self.config.vocab_size:
            bad = low if low < 0 else high
            raise QinferError(
                f"token id {bad} is outside the vocabulary (0..{self.config.vocab_size - 1})"
            )
        return tokens

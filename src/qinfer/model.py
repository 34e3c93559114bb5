"""The decoder-only transformer: embed -> N x Block(attention, MLP) -> norm -> lm_head.

One class serves Qwen3, Qwen2/2.5, Llama 3.x, SmolLM2 and Mistral; their differences
(QK-norm, biases, tied heads, RoPE scaling, sliding windows) live in ModelConfig and in
which tensors the checkpoint holds.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from qinfer.config import ModelConfig
from qinfer.errors import QinferError
from qinfer.features import Features
from qinfer.kv_cache import KVCache, RotatingKVCache, StepMasks
from qinfer.layers.attention import Attention, Mask
from qinfer.layers.mlp import MLP
from qinfer.layers.norm import RMSNorm
from qinfer.weights import Weights, open_checkpoint


class Block:
    """One decoder layer: pre-norm attention and pre-norm MLP, each with a residual."""

    def __init__(
        self, layer_prefix: str, config: ModelConfig, weights: Weights, features: Features
    ):
        hidden, eps = (config.hidden_size,), config.rms_norm_eps
        self.input_layernorm = RMSNorm(
            config.hidden_size,
            weights.tensor(f"{layer_prefix}.input_layernorm.weight", hidden),
            eps,
        )
        self.self_attn = Attention(layer_prefix, config, weights, features)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size,
            weights.tensor(f"{layer_prefix}.post_attention_layernorm.weight", hidden),
            eps,
        )
        self.mlp = MLP(layer_prefix, config, weights)

    def __call__(self, x: torch.Tensor, offsets, cache, mask: Mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), offsets, cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer:
    """A loaded model. Call it on token ids (B, L) to get fp32 logits (B, L, vocab)."""

    def __init__(self, config: ModelConfig, weights: Weights, features: Features | None = None):
        self.config = config
        self.features = features or Features()
        self.dtype, self.device = weights.dtype, weights.device
        V, H = config.vocab_size, config.hidden_size
        self.embed_tokens = weights.tensor("model.embed_tokens.weight", (V, H))
        self.layers = [
            Block(f"model.layers.{i}", config, weights, self.features)
            for i in tqdm(
                range(config.num_hidden_layers), desc="loading layers", leave=False, disable=None
            )
        ]
        self.norm = RMSNorm(H, weights.tensor("model.norm.weight", (H,)), config.rms_norm_eps)
        # Untied per config means the checkpoint must hold its own lm_head: tying it to the
        # embeddings instead would be silently wrong output.
        tied = config.tie_word_embeddings
        self.lm_head = self.embed_tokens if tied else weights.tensor("lm_head.weight", (V, H))

    def make_cache(
        self,
        batch_size: int = 1,
        left_padding: torch.Tensor | list[int] | None = None,
        max_length: int | None = None,
    ) -> list[KVCache | RotatingKVCache]:
        """One cache per layer: contiguous for full attention, a ring for sliding windows.

        left_padding: (batch_size,) pad tokens at the start of each row of a batch.
        max_length: positions the cache may hold (default: the model's context).
        """
        limit = min(
            max_length or self.config.max_position_embeddings, self.config.max_position_embeddings
        )
        step_masks = StepMasks()  # every layer of one window builds the same mask each step
        caches: list[KVCache | RotatingKVCache] = []
        for layer in range(self.config.num_hidden_layers):
            window = self.config.window(layer)
            if window is None:
                caches.append(KVCache(batch_size, limit, left_padding, step_masks))
            else:
                caches.append(RotatingKVCache(window, batch_size, limit, left_padding, step_masks))
        return caches

    @torch.inference_mode()
    def __call__(
        self,
        tokens: torch.Tensor,
        offsets: int | torch.Tensor | None = None,
        cache: list | None = None,
        mask: Mask = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """tokens (B, L) -> logits (B, L, vocab) in fp32 ((B, 1, vocab) with last_only).

        offsets: position of each row's first token (int or (B,)); by default where the
            cache left off (0 without a cache).
        cache: from `make_cache`; without one, the call sees only these tokens.
        mask: "causal" (the default) or a boolean (B, 1, L, S) tensor.
        """
        tokens = self._check_tokens(tokens)
        B, L = tokens.shape
        if cache is None:
            cache = self.make_cache(B, max_length=L)
        elif len(cache) != len(self.layers):
            raise QinferError(f"cache has {len(cache)} layers, the model has {len(self.layers)}")
        if offsets is None:
            offsets = cache[0].offsets
        self._check_positions(offsets, L)
        h = F.embedding(tokens, self.embed_tokens)  # (B, L, hidden)
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            h = layer(h, offsets, layer_cache, "causal" if mask is None else mask)
        if last_only:
            h = h[:, -1:]
        return F.linear(self.norm(h), self.lm_head).float()

    def _check_positions(self, offsets: int | torch.Tensor, L: int) -> None:
        # RoPE is tabulated up to max_position_embeddings and runs before any cache could
        # refuse the step, so positions past the context are caught here.
        last = (offsets if isinstance(offsets, int) else int(offsets.max())) + L - 1
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
        # Checked where the ids are, before the copy: ids built on the host (the engine's,
        # each decode step's) then cost no device round trip.
        low, high = (int(end) for end in torch.aminmax(tokens))
        if low < 0 or high >= self.config.vocab_size:
            bad = low if low < 0 else high
            raise QinferError(
                f"token id {bad} is outside the vocabulary (0..{self.config.vocab_size - 1})"
            )
        return tokens.to(self.device, torch.long)


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(dtype: str | torch.dtype | None, config: ModelConfig, device: torch.device):
    """The dtype to load weights in: as asked, else the checkpoint's (fp16 becomes bf16 on CPU,
    where fp16 matmuls are slow), else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None:
        if dtype not in _DTYPES:
            raise QinferError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    chosen = _DTYPES.get(str(config.torch_dtype).removeprefix("torch."), torch.float32)
    if chosen == torch.float16 and device.type == "cpu":
        return torch.bfloat16
    return chosen


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def load_model(
    path: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    features: Features | None = None,
) -> Transformer:
    """Load a checkpoint: a Hugging Face folder (config.json + safetensors) or a .gguf file."""
    device = torch.device(device) if device is not None else default_device()
    config, weights = open_checkpoint(path, lambda c: resolve_dtype(dtype, c, device), device)
    return Transformer(config, weights, features)

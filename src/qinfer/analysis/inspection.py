"""What the model does with one prompt, made visible: attention weights, next-token
probabilities, and the logit lens.

    ids = encode_prompt(tokenizer, "The capital of France is")
    seen = inspect_tokens(model, ids, layers=[0, 3], top_k=5)
    seen.attention[3]        # (Hq, L, L) fp32: layer 3's weights, one matrix per query head
    seen.next_tokens         # TopTokens (L, k): the model's next-token guesses after each token
    seen.logit_lens[3]       # TopTokens (L, k): layer 3's residual read through norm + lm_head

The forward is the model's own (`Transformer.forward`'s loop, kept open to read each
layer's residual) on fresh caches of its own, through the reference attention backend with
the seed's function in fp32; an inspected layer's attention function is a recorder that
computes `attention_weights_grouped`, keeps them, and weighs the values with them. It reads the model's weights and nothing else, so a server's KV
pool and its other requests are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qinfer.attention.reference import ReferenceAttention
from qinfer.attention.sdpa import (
    Mask,
    attention_weights_grouped,
    reference_sdpa_fp32,
    weigh_values_grouped,
)
from qinfer.core.errors import RequestError
from qinfer.core.forward_batch import ForwardBatch
from qinfer.model.transformer import Transformer

#: Longest prompt inspected: the weights of one head grow with its square.
MAX_INSPECT_TOKENS = 256
#: Most attention weights one inspection returns (layers x heads x tokens x tokens).
MAX_ATTENTION_WEIGHTS = 2**20
#: Most candidates listed per position (next tokens and each layer's lens).
MAX_TOP_K = 20


@dataclass
class TopTokens:
    """The k likeliest tokens after each of L positions: ids (L, k) long and their
    probabilities (L, k) fp32, likeliest first."""

    ids: torch.Tensor
    probs: torch.Tensor


@dataclass
class Inspection:
    """One prompt seen through the model (see the module docstring)."""

    token_ids: list[int]
    #: layer -> (heads, L, L) fp32; `heads` lists which query heads, in this order.
    attention: dict[int, torch.Tensor]
    heads: list[int]
    next_tokens: TopTokens
    #: One TopTokens per layer: what the residual after that layer would predict.
    logit_lens: list[TopTokens]


class AttentionRecorder:
    """The attention function of an inspected layer (`ReferenceAttention`'s per-layer hook):
    the reference path's two halves, keeping the weights of the chosen heads between them.

    The weights are computed once, and they are the very ones that weigh the values (the
    layer's usual function, perhaps torch's fused kernel, never forms them).
    """

    def __init__(self, heads: list[int]):
        self.heads = heads
        self.weights: torch.Tensor | None = None  # (heads, L, S) once attended

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: Mask
    ) -> torch.Tensor:
        """As `reference_sdpa_fp32`: q (1, Hq, L, D), k, v (1, Hkv, S, D) -> (1, Hq, L, D)."""
        weights = attention_weights_grouped(q.float(), k.float(), scale, mask)  # (1, Hq, L, S)
        self.weights = weights[0, self.heads].cpu()  # (heads, L, S)
        return weigh_values_grouped(weights, v.float()).to(q.dtype)


def check_inspection(
    model: Transformer,
    token_ids: Sequence[int],
    layers: Sequence[int],
    heads: Sequence[int] | None,
    top_k: int,
) -> list[int]:
    """Refuse what `inspect_tokens` cannot answer, with a RequestError naming the field
    (prompt, layers, heads, top_k); returns the heads to keep (default: all)."""
    config, num_tokens = model.config, len(token_ids)
    if model.parallel.world_size > 1:
        raise RequestError(
            f"inspection needs the whole model; this one is split over "
            f"{model.parallel.world_size} tensor-parallel ranks"
        )
    if not 1 <= num_tokens <= MAX_INSPECT_TOKENS:
        raise RequestError(
            f"prompt is {num_tokens} tokens; inspection takes 1 to {MAX_INSPECT_TOKENS}",
            param="prompt",
        )
    outside = next((t for t in token_ids if not 0 <= t < config.vocab_size), None)
    if outside is not None:
        raise RequestError(
            f"prompt: token id {outside} is outside the vocabulary (0..{config.vocab_size - 1})",
            param="prompt",
        )
    for layer in layers:
        if not 0 <= layer < config.num_hidden_layers:
            raise RequestError(
                f"layers: layer {layer} does not exist; the model has layers "
                f"0..{config.num_hidden_layers - 1}",
                param="layers",
            )
    heads = list(range(config.num_attention_heads)) if heads is None else list(heads)
    for head in heads:
        if not 0 <= head < config.num_attention_heads:
            raise RequestError(
                f"heads: head {head} does not exist; the model has query heads "
                f"0..{config.num_attention_heads - 1}",
                param="heads",
            )
    if not heads:
        raise RequestError(
            "heads is empty: name at least one head (or leave it out)", param="heads"
        )
    asked = len(set(layers)) * len(heads) * num_tokens**2
    if asked > MAX_ATTENTION_WEIGHTS:
        raise RequestError(
            f"layers: {len(set(layers))} layers x {len(heads)} heads x {num_tokens}² tokens is "
            f"{asked} attention weights, more than the {MAX_ATTENTION_WEIGHTS} one inspection "
            "returns; ask for fewer layers or heads, or a shorter prompt",
            param="layers",
        )
    if not 1 <= top_k <= MAX_TOP_K:
        raise RequestError(f"top_k must be 1 to {MAX_TOP_K}, got {top_k}", param="top_k")
    return heads


@torch.inference_mode()
def inspect_tokens(
    model: Transformer,
    token_ids: Sequence[int],
    layers: Sequence[int] = (0,),
    heads: Sequence[int] | None = None,
    top_k: int = 5,
) -> Inspection:
    """Run `token_ids` (ids inside the vocabulary, e.g. from `encode_prompt`) through the
    model once and record what the module docstring lists.

    layers, heads: whose attention weights to keep (heads: query heads, default all).
    Raises RequestError (naming the field) for what `check_inspection` refuses.
    """
    heads = check_inspection(model, token_ids, layers, heads, top_k)
    L = len(token_ids)
    caches = model.make_cache(1, max_length=L)  # sliding windows keep their own cache kind
    recorders = {layer: AttentionRecorder(heads) for layer in dict.fromkeys(layers)}
    attention = ReferenceAttention(caches, 1, L, "causal", reference_sdpa_fp32, recorders)
    tokens = torch.tensor([list(token_ids)], dtype=torch.long, device=model.device)
    batch = ForwardBatch.from_rows(tokens, 0, attention)
    # Transformer.forward's loop, with each layer's residual read on the way.
    h = model.embed(batch.token_ids)  # (L, hidden)
    lens = []
    for block in model.layers:
        h = block(h, batch)
        lens.append(top_tokens(model.compute_logits(h), top_k))
    return Inspection(
        token_ids=list(token_ids),
        attention={layer: recorder.weights for layer, recorder in recorders.items()},
        heads=heads,
        # The last layer's residual through norm and lm_head is the model's own output.
        next_tokens=lens[-1],
        logit_lens=lens,
    )


def top_tokens(logits: torch.Tensor, k: int) -> TopTokens:
    """The k likeliest tokens of each row of logits (L, V), with their softmax probabilities."""
    probs, ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    return TopTokens(ids=ids.cpu(), probs=probs.cpu())

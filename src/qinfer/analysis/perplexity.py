"""Perplexity, and the divergence of one model from a reference, measured as llama.cpp's
`llama-perplexity` measures them.

    result = perplexity(model, ids, context=512)                    # exp(mean NLL)
    result = perplexity(model, ids, context=512, base=reference)    # + KL(base || model)

The text's token ids are cut into chunks of `context` tokens; each chunk runs as one
forward, and only its second half is scored, so that every scored token sees at least
context / 2 tokens before it (llama-perplexity's rule). A scored position i predicts token
i + 1 from the logits at i. With a base (the reference: the same checkpoint in fp32, say),
the same positions also give the KL divergence of the model's next-token distribution from
the base's, and whether their top tokens agree.

Only the scored rows produce logits (`ForwardBatch.logits_indices`), so a 262k vocabulary
over a 512-token chunk costs 256 rows of logits, not 512.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from qinfer.core.errors import QinferError
from qinfer.model.transformer import Transformer


@dataclass(frozen=True)
class PerplexityResult:
    """What `perplexity` measured over `scored` tokens in `chunks` chunks.

    nll: mean negative log-likelihood (nats); perplexity: exp(nll). With a base: kl, the
    mean KL(base || model) per scored token (nats), kl_max its largest, and top1, the share
    of scored positions where both models' likeliest token is the same.
    """

    chunks: int
    scored: int
    nll: float
    perplexity: float
    kl: float | None = None
    kl_max: float | None = None
    top1: float | None = None


#: Scores one chunk: its ids (context,) -> fp32 log-probabilities (context / 2 - 1, V) of the
#: next token at positions context / 2 .. context - 2 (`scored_log_probs` for a qinfer model;
#: a peer, such as llama.cpp in `bench/kl_divergence.py`, brings its own).
Scorer = Callable[[torch.Tensor], torch.Tensor]


def perplexity(
    model: Transformer,
    ids: Sequence[int],
    context: int = 512,
    base: Transformer | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """Score `ids` in chunks of `context` tokens (see the module docstring).

    base: a reference model with the same vocabulary, run on the same chunks;
    progress(done, total) is called after each chunk.
    """
    if context > model.config.max_position_embeddings:
        raise QinferError(
            f"context of {context} tokens is longer than the model's "
            f"({model.config.max_position_embeddings}, max_position_embeddings)"
        )
    vocab = model.config.vocab_size
    outside = next((t for t in ids if not 0 <= t < vocab), None)
    if outside is not None:
        raise QinferError(f"token id {outside} is outside the vocabulary (0..{vocab - 1})")
    if base is not None and base.config.vocab_size != vocab:
        raise QinferError(
            f"the base model's vocabulary ({base.config.vocab_size}) is not the model's ({vocab})"
        )
    base_scorer = None if base is None else partial(scored_log_probs, base)
    return score(partial(scored_log_probs, model), ids, context, base_scorer, progress)


def score(
    scorer: Scorer,
    ids: Sequence[int],
    context: int,
    base: Scorer | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """`perplexity` over any scorer (and base scorer) of the same vocabulary."""
    if context < 4 or context % 2:
        raise QinferError(f"context must be an even number of at least 4 tokens, got {context}")
    chunks = len(ids) // context
    if chunks == 0:
        raise QinferError(
            f"the text is {len(ids)} tokens, shorter than one chunk of {context}: "
            "give a longer text or a smaller context"
        )
    nll, kl, kl_max, agree, scored = 0.0, 0.0, 0.0, 0, 0
    for c in range(chunks):
        chunk = torch.tensor(ids[c * context : (c + 1) * context])
        log_probs = scorer(chunk)  # (context / 2 - 1, V)
        targets = chunk[context // 2 + 1 :]  # the token each scored row predicts
        nll -= log_probs.gather(1, targets[:, None]).sum().item()
        scored += len(targets)
        if base is not None:
            base_log_probs = base(chunk)
            per_token = (base_log_probs.exp() * (base_log_probs - log_probs)).sum(-1)
            kl += per_token.sum().item()
            kl_max = max(kl_max, per_token.max().item())
            agree += (base_log_probs.argmax(-1) == log_probs.argmax(-1)).sum().item()
        if progress is not None:
            progress(c + 1, chunks)
    mean = nll / scored
    if base is None:
        return PerplexityResult(chunks, scored, mean, math.exp(mean))
    return PerplexityResult(
        chunks, scored, mean, math.exp(mean), kl / scored, kl_max, agree / scored
    )


@torch.inference_mode()
def scored_log_probs(model: Transformer, chunk: torch.Tensor) -> torch.Tensor:
    """chunk (context,) ids -> fp32 log-probabilities (context / 2 - 1, V) of the next token
    at positions context / 2 .. context - 2, from one forward over the whole chunk."""
    n = len(chunk)
    tokens = chunk.to(model.device)[None]  # (1, n)
    batch = model.rows_batch(tokens, 0, model.make_cache(1, max_length=n))
    rows = torch.arange(n // 2, n - 1, device=model.device)
    logits = model.compute_logits(model.forward(batch)[rows])
    return torch.log_softmax(logits, dim=-1).cpu()

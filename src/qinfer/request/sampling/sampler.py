"""Choose one token per row (`sample`): greedy or drawn with each row's own generator,
rejection sampling of proposed tokens, the chosen tokens' logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qinfer.core.errors import SamplingError
from qinfer.request.sampling.argmax import argmax_rows
from qinfer.request.sampling.params import SamplingParams
from qinfer.request.sampling.processors import LogitsProcessor, apply_penalties, process_logits


def make_generator(params: SamplingParams, device: str | torch.device) -> torch.Generator | None:
    """A generator seeded with `params.seed` on `device`, or None (the global RNG) without one."""
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


@dataclass
class SampleResult:
    """The chosen token of each row of logits `sample` was given: a step's rows, one per
    decoding sequence, or several for a sequence that verifies proposed tokens.

    token_ids: (B,) long, the chosen id of each row.
    logprobs: (B,) fp32, log-probability of each chosen id (see the module docstring), or
    None when no row asked for log-probabilities (`params.logprobs` None in every row:
    the (B, V) log-softmax is then never computed).
    top_logprobs: per row, None or the `params.logprobs` most likely (id, logprob) pairs,
    most likely first.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_logprobs: list[list[tuple[int, float]] | None]


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
    prompt_lens: Sequence[int] | None = None,
    logits_processors: Sequence[Sequence[LogitsProcessor]] | None = None,
    proposed: Sequence[int | None] | None = None,
) -> SampleResult:
    """Choose one token per row.

    logits: (B, V) fp32, the last position's logits of each row.
    params: B SamplingParams, one per row.
    histories: B sequences of ids, each row's prompt followed by its generated tokens.
    generators: B generators (None = the global RNG), see `make_generator`.
    prompt_lens: how many leading ids of each history are prompt; presence and frequency
    penalties count only the ids after them. None: the whole history counts as generated.
    logits_processors: B sequences (maybe empty) of the processors of each row, or None.
    proposed: B proposed ids (None: the row has none), or None; a row keeps its proposal
    exactly when the result names it (see the module docstring).
    """
    if logits.dim() != 2:
        raise SamplingError(f"sample expects logits of shape (B, V), got {tuple(logits.shape)}")
    batch = logits.shape[0]
    if not (len(params) == len(histories) == len(generators) == batch):
        raise SamplingError(
            f"sample got {batch} rows of logits but {len(params)} params, "
            f"{len(histories)} histories and {len(generators)} generators"
        )
    logits = logits.float()
    if logits_processors is not None and any(logits_processors):
        logits = logits.clone()  # the processors may write in place
        for b, processors in enumerate(logits_processors):
            for processor in processors:
                logits[b] = processor(logits[b])
    logits = apply_penalties(logits, params, histories, prompt_lens)

    token_ids = argmax_rows(logits)  # (B,) greedy choice; sampled rows overwrite below
    # Rows with a top_k draw among their k best candidates, the others over the whole
    # vocabulary: a row's draw depends only on its own logits, params and generator,
    # never on which rows share its batch.
    for with_top_k in (True, False):
        rows = [b for b, p in enumerate(params) if not p.greedy and (p.top_k > 0) == with_top_k]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            token_ids[index] = _sample_rows(
                logits[index],
                [params[b] for b in rows],
                [generators[b] for b in rows],
                None if proposed is None else [proposed[b] for b in rows],
            )

    if all(p.logprobs is None for p in params):
        return SampleResult(token_ids, None, [None] * batch)
    logprobs_all = torch.log_softmax(logits, dim=-1)  # (B, V)
    chosen_logprobs = logprobs_all.gather(1, token_ids[:, None])[:, 0]  # (B,)
    return SampleResult(token_ids, chosen_logprobs, _top_logprobs(logprobs_all, params))


def _sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    proposed: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """Draw one token id per row of logits (R, V) from its processed distribution -> (R,),
    keeping each row's proposed id by rejection sampling where it has one."""
    probs, candidates = sampling_distribution(logits, params)  # (R, K)
    widths = [min(p.top_k or probs.shape[-1], probs.shape[-1]) for p in params]
    accepted = {}
    if proposed is not None and any(d is not None for d in proposed):
        accepted = _accept_proposals(probs, candidates, proposed, generators)
    picked = _draw(probs, generators, widths)  # (R,) column in K
    for row, column in accepted.items():
        picked[row] = column
    return picked if candidates is None else candidates.gather(1, picked[:, None])[:, 0]


def _accept_proposals(
    probs: torch.Tensor,
    candidates: torch.Tensor | None,
    proposed: Sequence[int | None],
    generators: Sequence[torch.Generator | None],
) -> dict[int, int]:
    """Rejection sampling of point-mass proposals: row r keeps its proposal d with
    probability probs[r, d]; a rejected row gets probs[r, d] = 0 in place, so that the
    draw that follows is from the residual distribution.

    probs: (R, K) each row's distribution over its K candidates (candidates (R, K) ids, or
    None: column i is token i). Returns {row: column of its proposal} for the rows that
    keep it. Each such row draws one uniform from its own generator first (seeded rows
    reproduce).
    """
    rows = [r for r, d in enumerate(proposed) if d is not None]
    ids = torch.tensor([proposed[r] for r in rows], device=probs.device)  # (P,)
    index = torch.tensor(rows, device=probs.device)
    if candidates is None:
        columns = ids
        present = torch.ones_like(ids, dtype=torch.bool)
    else:  # the proposal's column among the row's candidates, if it is one of them
        match = candidates[index] == ids[:, None]  # (P, K)
        present, columns = match.any(dim=1), match.int().argmax(dim=1)
    p = torch.where(present, probs[index, columns], 0.0).tolist()
    columns = columns.tolist()
    accepted = {}
    for i, row in enumerate(rows):
        uniform = torch.rand(1, generator=generators[row], device=probs.device).item()
        if uniform < p[i]:
            accepted[row] = columns[i]
        elif p[i] > 0.0:
            probs[row, columns[i]] = 0.0
    return accepted


def sampling_distribution(
    logits: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What each row samples from: (probs (R, K), candidate ids (R, K) or None).

    When every row has a top_k, only its top max(top_k) logits can survive, so temperature,
    top-p and min-p run on those K candidates instead of the whole vocabulary (K = 20
    against V = 151,936 for Qwen3's defaults); the probabilities are those of
    softmax(process_logits(logits)) at the candidates. Otherwise K = V and the candidate
    ids are None (column i is token i).
    logits: (R, V) fp32 after penalties, rows that sample (temperature > 0).
    """
    candidates = None
    if all(p.top_k > 0 for p in params):
        k = min(max(p.top_k for p in params), logits.shape[-1])
        logits, candidates = torch.topk(logits, k, dim=-1)  # (R, K), most likely first
    return process_logits(logits, params).softmax(dim=-1), candidates


def _draw(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None], widths: Sequence[int]
) -> torch.Tensor:
    """One column per row of probs (R, K), column i with probability probs[r, i].

    The exponential race: argmax(probs / E) with E ~ Exp(1) i.i.d. picks column i with
    probability probs[i]; one elementwise pass instead of multinomial's cumulative sum.
    Row r draws noise for its first widths[r] columns only (its own top_k; the columns
    after them have probability 0), from its own generator, so a seeded row reproduces
    whatever rows share its batch.
    """
    noise = torch.ones_like(probs)
    for row, (generator, width) in enumerate(zip(generators, widths, strict=True)):
        noise[row, :width].exponential_(generator=generator)
    # A zero draw would turn a masked column's 0/0 into NaN, which argmax would pick.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def _top_logprobs(
    logprobs: torch.Tensor, params: Sequence[SamplingParams]
) -> list[list[tuple[int, float]] | None]:
    wanted = [p.logprobs or 0 for p in params]
    if not any(wanted):
        return [None if p.logprobs is None else [] for p in params]
    values, ids = torch.topk(logprobs, max(wanted), dim=-1)  # (B, n)
    values, ids = values.tolist(), ids.tolist()
    return [
        None
        if p.logprobs is None
        else list(zip(ids[b][: p.logprobs], values[b][: p.logprobs], strict=True))
        for b, p in enumerate(params)
    ]

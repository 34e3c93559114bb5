"""When a request ends: the one rule every request follows (`RequestState.accept` applies
it to each sampled token, whichever front-end made the request).

After each sampled token (already counted as generated):

1. one of the request's `stop_token_ids` ends it ("stop"), and an end-of-sequence id
   ends it ("eos") unless `ignore_eos`; neither token becomes part of the text;
2. otherwise the token's text goes through the detokenizer, which may complete a stop
   string ("stop", the stop string trimmed);
3. otherwise reaching `max_tokens` ends it ("length").

When a request ends, the text the detokenizer held back (a possible stop-string start,
an unfinished character) is flushed into the step's text.
"""

from __future__ import annotations

from dataclasses import dataclass

from qinfer.request.sampling import SamplingParams
from qinfer.text.detokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class TokenStep:
    """What one sampled token did to a request."""

    text: str  # the text it makes safe to show ("" when none)
    finish_reason: str | None = None  # None (going on), "eos", "stop" or "length"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


def accept_token(
    token_id: int,
    params: SamplingParams,
    eos_ids: frozenset[int],
    detokenizer: IncrementalDetokenizer | None,
    num_generated: int,
    max_tokens: int,
) -> TokenStep:
    """Apply the module's rule to `token_id`, the request's `num_generated`-th token.

    max_tokens: the request's budget, already cut to the room its context leaves.
    """
    if token_id in params.stop_token_ids:
        return TokenStep(_flush(detokenizer), "stop", token_id)
    if not params.ignore_eos and token_id in eos_ids:
        return TokenStep(_flush(detokenizer), "eos")
    text = detokenizer.push(token_id) if detokenizer is not None else ""
    if detokenizer is not None and detokenizer.stopped:
        return TokenStep(text, "stop", detokenizer.matched_stop)
    if num_generated >= max_tokens:
        return TokenStep(text + _flush(detokenizer), "length")
    return TokenStep(text)


def _flush(detokenizer: IncrementalDetokenizer | None) -> str:
    return detokenizer.finish() if detokenizer is not None else ""

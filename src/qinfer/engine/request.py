"""`Request`: one engine request, a scheduled `Sequence` plus what turns its tokens into
a response."""

from __future__ import annotations

from typing import Any

from qinfer.engine.outputs import RequestOutput, TokenLogprob
from qinfer.engine.prompt_logprobs import PromptLogprobs
from qinfer.engine.sequence import Sequence
from qinfer.engine.tasks import Task
from qinfer.request.sampling import SamplingParams
from qinfer.request.state import RequestState


class Request:
    """A sequence plus what turns its tokens into a response: its task (generate, pool or
    score: `qinfer.engine.tasks`), its RequestState (params, generator, text, stop rule,
    processors), its logprobs and what was already sent.

    The state appends sampled ids to the sequence's own token list. One with
    `params.prompt_logprobs` gathers them while its prompt runs
    (`qinfer.engine.prompt_logprobs`).
    """

    def __init__(self, seq: Sequence, prompt: str | None, state: RequestState, task: Task) -> None:
        self.seq = seq
        self.prompt = prompt
        self.state = state
        self.task = task
        self.results: dict[str, Any] = {}  # output fields a task that does not sample fills
        self.logprobs: list[TokenLogprob] | None = [] if state.params.logprobs is not None else None
        top_n = state.params.prompt_logprobs
        self.prompt_logprobs = (
            None if top_n is None else PromptLogprobs(seq.token_ids[: seq.num_prompt_tokens], top_n)
        )
        self.finish_reason: str | None = None  # OpenAI's: EOS is a "stop"
        self.num_sent_tokens = 0  # tokens already handed out in outputs
        self.num_sent_chars = 0

    @property
    def params(self) -> SamplingParams:
        return self.state.params

    def num_logits(self, n: int) -> int:
        """Rows of its n new tokens this step, counted from the last, whose logits it needs:
        every row while it gathers prompt logprobs; else, once all its tokens are computed
        and its task reads them, the last (to sample or score) and one per proposed token
        (speculative decoding: each verifies one); else none (a prompt chunk, a pooling
        request)."""
        if self.prompt_logprobs is not None and not self.prompt_logprobs.complete:
            return n
        if not self.task.reads_last_logits:
            return 0
        seq = self.seq
        return 1 + len(seq.proposed) if n == seq.num_scheduled_tokens else 0

    def output(self) -> RequestOutput:
        """The request as it stands, with what is new since the previous output."""
        seq, text = self.seq, self.state.text
        token_ids = self.state.output_token_ids
        out = RequestOutput(
            request_id=seq.request_id,
            prompt=self.prompt,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            text=text,
            token_ids=token_ids,
            delta_text=text[self.num_sent_chars :],
            delta_token_ids=token_ids[self.num_sent_tokens :],
            finished=seq.is_finished,
            finish_reason=self.finish_reason,
            stop_reason=self.state.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
            num_generated_tokens=self.state.num_generated_tokens,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            prompt_opened_think=self.state.prompt_opened_think,
            prompt_logprobs=(
                self.prompt_logprobs.entries
                if self.prompt_logprobs is not None and self.prompt_logprobs.complete
                else None
            ),
            **self.results,
        )
        self.num_sent_tokens, self.num_sent_chars = len(token_ids), len(text)
        return out

"""Driving an engine through some requests to their ends: the one loop behind every
front-end (`qinfer.generate` and `stream_generate`, `LLM.generate` and `LLM.stream`, the
command line).

    for output in run_requests(engine, requests): ...     # each output as it comes
    stream = TextStream(engine, request)                  # one request's text deltas
    for delta in stream: ...                              # then stream.result
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from qinfer.core.errors import QinferError
from qinfer.engine.engine import Engine
from qinfer.engine.outputs import GenerationResult, RequestOutput, Timings
from qinfer.engine.request import Request
from qinfer.text.reasoning import split_reasoning


def run_requests(engine: Engine, requests: Sequence[Request]) -> Iterator[RequestOutput]:
    """Queue `requests` (made by `engine.make_request`) and step the engine until all have
    finished, yielding their outputs as they come (a finished request's last one included).

    An error, Ctrl-C or a reader that stops early aborts every request still unfinished:
    none keeps its KV blocks.
    """
    pending: set[str] = set()
    try:
        for request in requests:
            engine.add(request)
            pending.add(request.seq.request_id)
        while pending:
            for output in engine.step():
                if output.request_id in pending:
                    if output.finished:
                        pending.discard(output.request_id)
                    yield output
    finally:
        for request_id in pending:
            engine.abort(request_id)


class RequestClock:
    """When each request of a run started, gave its first token and finished."""

    def __init__(self) -> None:
        self.started_at = time.perf_counter()
        self.first_token_at: dict[str, float] = {}
        self.finished_at: dict[str, float] = {}

    def saw(self, output: RequestOutput) -> None:
        now = time.perf_counter()
        self.first_token_at.setdefault(output.request_id, now)
        if output.finished:
            self.finished_at[output.request_id] = now

    def result(self, request: Request) -> GenerationResult:
        """The request's GenerationResult (it has finished), from its RequestState."""
        state, request_id = request.state, request.seq.request_id
        first = self.first_token_at.get(request_id, self.started_at)
        timings = Timings(
            prefill_seconds=first - self.started_at,
            decode_seconds=self.finished_at.get(request_id, first) - first,
            prompt_tokens=state.num_prompt_tokens,
            generated_tokens=state.num_generated_tokens,
        )
        reasoning = answer = None
        if state.prompt_opened_think is not None:
            reasoning, answer = split_reasoning(state.text, state.prompt_opened_think)
        return GenerationResult(
            text=state.text,
            token_ids=state.output_token_ids,
            finish_reason=state.finish_reason or "length",
            prompt_tokens=state.num_prompt_tokens,
            generated_tokens=state.num_generated_tokens,
            timings=timings,
            reasoning=reasoning,
            answer=answer,
        )


def run_to_end(engine: Engine, requests: Sequence[Request]) -> list[GenerationResult]:
    """Every request's GenerationResult, in order, once all have finished."""
    clock = RequestClock()
    for output in run_requests(engine, requests):
        clock.saw(output)
    return [clock.result(request) for request in requests]


class TextStream:
    """Iterate for the text deltas of one request; `.result` (a GenerationResult) is set
    when the iteration ends. Joined, the deltas equal `result.text`. The request was
    checked when it was made; the engine runs as the stream is read."""

    def __init__(self, engine: Engine, request: Request) -> None:
        self._engine, self._request = engine, request
        self._started = False
        self.result: GenerationResult | None = None

    @property
    def prompt_opened_think(self) -> bool | None:
        """Whether the prompt ended inside `<think>` (None for a model that does not think),
        as the request decided it once: for splitting text the stream showed."""
        return self._request.state.prompt_opened_think

    def __iter__(self) -> Iterator[str]:
        if self._started:
            raise QinferError("a TextStream can be read only once")
        self._started = True
        clock = RequestClock()
        for output in run_requests(self._engine, [self._request]):
            clock.saw(output)
            if output.delta_text:
                yield output.delta_text
        self.result = clock.result(self._request)

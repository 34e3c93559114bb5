"""The offline API: many prompts in, their completions out, batched by the engine.

llm = LLM("path/to/checkpoint", max_num_seqs=16)
outputs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))
for delta in llm.stream("Hello"): print(delta, end="")   # one prompt, as text deltas
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from qinfer.engine.engine import Engine, Request, build_engine
from qinfer.engine.outputs import RequestOutput
from qinfer.errors import QinferError, RequestError
from qinfer.generate import GenerationResult, Timings
from qinfer.model import Transformer
from qinfer.prompts import Prompt, is_batch
from qinfer.reasoning import prompt_opened_think, split_reasoning, splits_reasoning
from qinfer.sampling import SamplingParams
from qinfer.tokenizer import Tokenizer


class LLM:
    """A model with a batching engine, for offline generation.

    model_or_path: a loaded `Transformer`, or a checkpoint (folder or .gguf) to load.
    tokenizer: a `Tokenizer` or its path; by default the checkpoint's (without one, prompts
        must be token ids). dtype, device, quantize, group_size: as for `qinfer.load_model`,
    when a path is given. tensor_parallel_size: ranks the checkpoint is split over (N - 1
    worker processes, see `qinfer.distributed`; `close()` or this process's exit stops
    them). engine_args: see `qinfer.engine.EngineConfig`.
    """

    def __init__(
        self,
        model_or_path: Transformer | str | Path,
        tokenizer: Tokenizer | str | Path | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        quantize: str | None = None,
        group_size: int = 32,
        tensor_parallel_size: int = 1,
        **engine_args,
    ) -> None:
        self.engine: Engine = build_engine(
            model_or_path,
            tokenizer,
            dict(dtype=dtype, device=device, quantize=quantize, group_size=group_size),
            engine_args,
            tensor_parallel_size,
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt (text, token ids or chat messages, or a list of them);
        the outputs come back in the prompts' order. params: one for all, or one each."""
        if isinstance(prompts, (list, tuple)) and not prompts:
            raise RequestError("prompts is empty: give at least one prompt")
        prompts = list(prompts) if is_batch(prompts) else [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif len(params) != len(prompts):
            raise RequestError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        engine = self.engine
        # Check every prompt before queueing any, so a bad one leaves the engine untouched.
        requests = [engine.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        finished: dict[str, RequestOutput] = {}
        try:
            for request in requests:
                engine.add(request)
            with tqdm(total=len(requests), desc="requests", disable=not use_tqdm) as bar:
                while len(finished) < len(requests):
                    for output in engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
        except BaseException:  # an error or Ctrl-C: leave no request holding blocks
            for request in requests:
                engine.abort(request.seq.request_id)
            raise
        return [_whole(finished[r.seq.request_id]) for r in requests]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> EngineTextStream:
        """One prompt as a stream of text deltas, as `qinfer.stream_generate` gives it (the
        command line's generate and chat use it under tensor parallelism). The prompt is
        checked here; the engine runs as the stream is read."""
        return EngineTextStream(self.engine, self.engine.make_request(prompt, params))

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        self.engine.close()


class EngineTextStream:
    """Iterate for the text deltas of one request; `.result` (a `GenerationResult`, as
    `qinfer.generate.TextStream` sets it) is set when the iteration ends."""

    def __init__(self, engine: Engine, request: Request) -> None:
        self._engine, self._request = engine, request
        self._started = False
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        if self._started:
            raise QinferError("a stream can be read only once")
        self._started = True
        engine, seq = self._engine, self._request.seq
        started_at = time.perf_counter()
        first_token_at = last = None
        engine.add(self._request)
        try:
            while not seq.is_finished:
                for last in engine.step():  # this request's output, if it moved
                    first_token_at = first_token_at or time.perf_counter()
                    if last.delta_text:
                        yield last.delta_text
        except BaseException:  # an error, Ctrl-C or a reader that left: free its blocks
            engine.abort(seq.request_id)
            raise
        self.result = self._result(last, started_at, first_token_at)

    def _result(
        self, output: RequestOutput, started_at: float, first_token_at: float
    ) -> GenerationResult:
        # The engine ends an EOS with "stop" and no stop reason; qinfer.generate says "eos".
        eos = output.finish_reason == "stop" and output.stop_reason is None
        reasoning = answer = None
        tokenizer = self._engine.tokenizer
        if tokenizer is not None and splits_reasoning(tokenizer):
            opened = prompt_opened_think(tokenizer.decode(output.prompt_token_ids))
            reasoning, answer = split_reasoning(output.text, opened)
        return GenerationResult(
            text=output.text,
            token_ids=output.token_ids,
            finish_reason="eos" if eos else output.finish_reason,
            prompt_tokens=output.num_prompt_tokens,
            generated_tokens=output.num_generated_tokens,
            timings=Timings(
                prefill_seconds=first_token_at - started_at,
                decode_seconds=time.perf_counter() - first_token_at,
                prompt_tokens=output.num_prompt_tokens,
                generated_tokens=output.num_generated_tokens,
            ),
            reasoning=reasoning,
            answer=answer,
        )


def _whole(output: RequestOutput) -> RequestOutput:
    """The final output with its deltas covering the whole completion."""
    return replace(output, delta_text=output.text, delta_token_ids=output.token_ids)

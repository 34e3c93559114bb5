"""Text in, text out: prompt -> token ids -> one model forward per step -> text.

    generate(model, tokenizer, prompt, params)         -> GenerationResult
    generate(model, tokenizer, [p1, p2, ...], params)  -> [GenerationResult, ...]
    stream = stream_generate(model, tokenizer, prompt, params)
    for delta in stream: ...                           # text deltas; then stream.result

A prompt is a string (used as-is, or wrapped as one user message with `chat=True`), a
list of token ids (used as-is), or a list of chat messages (always rendered with the
tokenizer's chat template; template options such as Qwen3's `enable_thinking` pass
through as keyword arguments); see `qinfer.prompts`. Each row's per-request state
(params, generator, detokenizer, stop rule, a grammar's mask) is a
`qinfer.request_state.RequestState`, the same the engine uses.

A batch is left-padded into one KV cache: the cache masks each row's pad slots on every
step and keeps per-row positions, so each row gets exactly what it would get alone. The
prompt is prefilled in one forward (only the last position's logits are computed), then
every step runs one forward of one token per row still going; rows that finish are
dropped from the cache (`cache.select`) so they stop costing work.

A row ends with finish_reason
    "eos"     on one of the model's end-of-sequence ids (config, generation config and
              tokenizer together) unless `ignore_eos`,
    "stop"    on one of `stop_token_ids`, or when the text reaches a stop string (the stop
              string and whatever follows it are cut from the text),
    "length"  after `max_tokens` tokens, or when the model's context is full: max_tokens
              is cut to the room the context leaves after the (longest) prompt.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from qinfer.errors import QinferError
from qinfer.model import Transformer
from qinfer.prompts import Prompt, encode_prompt, eos_token_ids, is_batch
from qinfer.reasoning import prompt_opened_think, split_reasoning, splits_reasoning
from qinfer.request_state import RequestState, sample_next
from qinfer.sampling import SamplingParams
from qinfer.tokenizer import Tokenizer

#: Id written into the left-padding slots of a batch; the cache masks them, so any
#: id inside the vocabulary will do.
PAD_ID = 0


@dataclass(frozen=True)
class Timings:
    """Wall-clock time of one request: the prefill (up to the first token) and the decode."""

    prefill_seconds: float
    decode_seconds: float
    prompt_tokens: int
    generated_tokens: int

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first (which the prefill produced) per second of decoding."""
        steps = self.generated_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds else 0.0


@dataclass(frozen=True)
class GenerationResult:
    """What one prompt produced.

    token_ids holds every generated id, including an EOS or stop id that ended the row;
    text holds their decoded text, without special tokens and cut before a stop string.
    reasoning / answer: for a thinking model (a vocabulary with `</think>`, as Qwen3's), the
    text split into its `<think>...</think>` block and the answer after it (None otherwise).
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    generated_tokens: int
    timings: Timings
    reasoning: str | None = None
    answer: str | None = None


@dataclass
class _Row:
    """One prompt while its batch runs: its RequestState, plus timing and reasoning."""

    state: RequestState
    # A thinking model's prompt: whether it ended inside an open <think> block; None when
    # the vocabulary has no </think> (no reasoning split).
    opened_think: bool | None = None
    first_token_at: float = 0.0
    finished_at: float = 0.0

    def accept(self, token: int, now: float) -> str:
        """Record a sampled token; return the text it makes safe to show (maybe "")."""
        if not self.state.num_generated_tokens:
            self.first_token_at = now
        text = self.state.accept(token)
        if self.state.finished:
            self.finished_at = now
        return text

    def result(self, started_at: float) -> GenerationResult:
        state = self.state
        reasoning = answer = None
        if self.opened_think is not None:
            reasoning, answer = split_reasoning(state.text, self.opened_think)
        timings = Timings(
            prefill_seconds=self.first_token_at - started_at,
            decode_seconds=self.finished_at - self.first_token_at,
            prompt_tokens=state.num_prompt_tokens,
            generated_tokens=state.num_generated_tokens,
        )
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


def generate(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt: Prompt | Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    chat: bool = False,
    **template_kwargs,
) -> GenerationResult | list[GenerationResult]:
    """Generate for one prompt (-> GenerationResult) or a batch (a list of prompts, each
    text, token ids or a list of messages -> a list of GenerationResult, in order).

    params: one SamplingParams for every prompt, or one per prompt (default:
        SamplingParams()).
    """
    batch = is_batch(prompt)
    rows = _encode_rows(
        model, tokenizer, list(prompt) if batch else [prompt], params, chat, template_kwargs
    )
    results = _run_to_end(model, rows)
    return results if batch else results[0]


class TextStream:
    """Iterate for the text deltas of one prompt; `.result` (a GenerationResult) is set
    when the iteration ends. Joined, the deltas equal `result.text`."""

    def __init__(self, model: Transformer, row: _Row) -> None:
        self._model, self._row = model, row
        self._started = False
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        if self._started:
            raise QinferError("a TextStream can be read only once")
        self._started = True
        started_at = time.perf_counter()
        for _, delta in _run(self._model, [self._row]):
            if delta:
                yield delta
        self.result = self._row.result(started_at)


def stream_generate(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt: Prompt,
    params: SamplingParams | None = None,
    *,
    chat: bool = False,
    **template_kwargs,
) -> TextStream:
    """Like `generate` for one prompt, as a stream of text deltas. The prompt is checked
    here, before the first delta is asked for; the model runs as the stream is read."""
    if is_batch(prompt):
        raise QinferError("stream_generate takes one prompt; use generate for a batch")
    (row,) = _encode_rows(model, tokenizer, [prompt], params, chat, template_kwargs)
    return TextStream(model, row)


def generate_ids(
    model: Transformer,
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    eos_ids: frozenset[int] = frozenset(),
) -> list[GenerationResult]:
    """Token ids in, token ids out (no tokenizer: results carry empty text). For benchmarks
    and callers that tokenize themselves; rows end on `eos_ids` unless ignore_eos."""
    if not prompt_ids or any(len(ids) == 0 for ids in prompt_ids):
        raise QinferError("prompt_ids must hold at least one non-empty row of token ids")
    rows = _make_rows(model, [list(ids) for ids in prompt_ids], params, eos_ids, None)
    return _run_to_end(model, rows)


def _encode_rows(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: list[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None,
    chat: bool,
    template_kwargs: dict,
) -> list[_Row]:
    vocab = model.config.vocab_size
    encoded = [encode_prompt(tokenizer, p, chat, vocab, **template_kwargs) for p in prompts]
    rows = _make_rows(model, encoded, params, eos_token_ids(model, tokenizer), tokenizer)
    if splits_reasoning(tokenizer):
        for row, ids in zip(rows, encoded, strict=True):
            row.opened_think = prompt_opened_think(tokenizer.decode(ids))
    return rows


def _make_rows(
    model: Transformer,
    encoded: list[list[int]],
    params: SamplingParams | Sequence[SamplingParams] | None,
    eos: frozenset[int],
    tokenizer: Tokenizer | None,
) -> list[_Row]:
    if params is None:
        params = SamplingParams()
    params_list = list(params) if isinstance(params, Sequence) else [params] * len(encoded)
    if len(params_list) != len(encoded):
        raise QinferError(f"got {len(params_list)} SamplingParams for {len(encoded)} prompts")
    # Left padding makes every row as long as the longest prompt; the context must hold that.
    context = model.config.max_position_embeddings
    width = max(len(ids) for ids in encoded)
    if width >= context:
        raise QinferError(
            f"prompt has {width} tokens; the model's context ({context}) leaves no room to generate"
        )
    budget = context - width
    return [
        _Row(
            RequestState.create(
                list(ids),
                p,
                min(p.max_tokens, budget),
                eos,
                tokenizer,
                model.device,
            )
        )
        for ids, p in zip(encoded, params_list, strict=True)
    ]


def _run_to_end(model: Transformer, rows: list[_Row]) -> list[GenerationResult]:
    started_at = time.perf_counter()
    for _ in _run(model, rows):
        pass
    return [row.result(started_at) for row in rows]


def _run(model: Transformer, rows: list[_Row]) -> Iterator[tuple[int, str]]:
    """Run a batch of rows to their ends; yield (row index, text delta) as tokens come."""
    prompts = [list(row.state.token_ids) for row in rows]  # nothing generated yet
    lengths = [len(ids) for ids in prompts]
    width = max(lengths)
    padding = [width - n for n in lengths]
    # Token ids are built on the host: the model checks them there and copies them over.
    tokens = torch.tensor(
        [[PAD_ID] * pad + ids for pad, ids in zip(padding, prompts, strict=True)]
    )  # (B, width)
    cache = model.make_cache(
        len(rows),
        left_padding=padding if any(padding) else None,
        max_length=width + max(row.state.max_tokens for row in rows),
    )
    active = list(range(len(rows)))  # indices into rows, one per cache row
    logits = model(tokens, cache=cache, last_only=True)[:, -1]  # (B, V)
    while True:
        sampled = sample_next(logits, [rows[i].state for i in active])
        now = time.perf_counter()
        next_ids = sampled.token_ids.tolist()
        for i, token in zip(active, next_ids, strict=True):
            yield i, rows[i].accept(token, now)
        keep = [k for k, i in enumerate(active) if not rows[i].state.finished]
        if not keep:
            return
        if len(keep) < len(active):
            for layer_cache in cache:
                layer_cache.select(keep)
            active = [active[k] for k in keep]
            next_ids = [next_ids[k] for k in keep]
        # Sampled ids lie in the vocabulary and max_tokens keeps every position inside the
        # context: decode steps skip __call__'s checks (and their host syncs).
        step = torch.tensor(next_ids, device=model.device)[:, None]  # (B_active, 1)
        logits = model.run_rows(step, cache[0].offsets, cache)[:, -1]

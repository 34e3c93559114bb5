"""Sampling: choose the next token of every row from its logits, each row with its own settings.

The order of the steps is the one `transformers` uses, so its logits processors are the
reference the tests check against:

0. each row's own logits processors (`LogitsProcessor`: a request's `logit_bias`, a
   grammar's mask), in order, on the raw logits;
1. penalties:
   - `repetition_penalty` (HF / CTRL): every id in the row's *prompt and generated* tokens
     has its logit divided by the penalty when positive, multiplied when negative;
   - `presence_penalty`, `frequency_penalty` (OpenAI): counted over the *generated* tokens
     only (the ids of a history after its `prompt_len` first ones):
     `logit -= frequency_penalty * count + presence_penalty * (count > 0)`;
2. greedy rows (temperature 0, or top_k 1) take the argmax of the penalised logits;
3. the other rows: divide by temperature, keep the top_k highest, keep the smallest set
   whose probability reaches top_p, drop tokens below min_p x the top probability; then
   draw from the softmax with the row's own `torch.Generator` (seeded rows reproduce,
   whichever rows share their batch). Rows with a top_k do all of this on their k best
   candidates only, never touching the rest of the vocabulary.

A row may come with a *proposed* token (speculative decoding, `qinfer.engine.speculative`): a
guess of a proposer that put all its probability on it. The row then keeps the exact
distribution of step 3 by rejection sampling (Leviathan et al. 2023, Chen et al. 2023,
with a point-mass proposal): the proposal is accepted with probability p(proposal), else
the token is drawn from p with the proposal removed (the residual distribution), so
P(x) = p(x) for every x. A greedy row accepts the proposal when it is the argmax.

Log-probabilities returned are those of the model's distribution after the penalties and
before temperature and truncation: `log_softmax(penalised logits)`. They say how likely
the model found each token, whatever the sampling settings, and are never -inf for the
chosen token.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from qinfer.checkpoint import read_json_object
from qinfer.errors import SamplingError

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
#: The range of one `logit_bias` entry (OpenAI's: -100 bans a token, 100 all but forces it).
MAX_LOGIT_BIAS = 100.0
#: The fields that constrain the output; a request sets at most one.
CONSTRAINTS = ("json_schema", "regex", "grammar", "choice")


@dataclass(frozen=True)
class SamplingParams:
    """How to choose tokens for one request, and when to stop.

    temperature: 0 = greedy; top_k: 0 = off; top_p: 1 = off; min_p: 0 = off.
    repetition_penalty: 1 = off (> 1 discourages repeats, HF semantics).
    presence_penalty / frequency_penalty: 0 = off, in [-2, 2] (OpenAI semantics).
    max_tokens: at most this many new tokens (0: none, the request only runs its prompt,
    for its `prompt_logprobs`).
    stop: strings that end generation (not included in the output).
    stop_token_ids: ids that end generation besides the tokenizer's EOS ids.
    ignore_eos: keep going past EOS (benchmarks).
    seed: seeds this request's own generator, so its samples reproduce.
    logprobs: None = no log-probabilities; n = the chosen token's and the n most likely.
    prompt_logprobs: None = none; n = each prompt token's log-probability given the tokens
    before it, and the n most likely there (`qinfer.engine.prompt_logprobs`).
    logit_bias: {token id: bias in [-100, 100]} added to those logits before anything
    else (OpenAI semantics: -100 bans a token); stored as sorted (id, bias) pairs.
    thinking_budget: None = unbounded; n = a thinking model's `<think>` block is closed
    after n tokens of reasoning (`</think>` is forced, then the answer follows; Anthropic's
    `thinking.budget_tokens`).

    At most one constraint on the output (see `qinfer.grammar`): json_schema (a dict or
    its JSON text; objects listing properties without `additionalProperties` get false,
    as OpenAI's strict mode does), regex (the whole output matches it), grammar (Lark, or
    GBNF), choice (the output is exactly one of these strings).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    thinking_budget: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, Mapping):  # pairs, so params stay hashable
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        # Accept one value or any sequence (a request's JSON list); store tuples (hashable).
        object.__setattr__(self, "stop", _as_tuple("stop", self.stop, str))
        if self.choice is not None:
            object.__setattr__(self, "choice", _as_tuple("choice", self.choice, str))
        if isinstance(self.json_schema, Mapping):  # stored as text, so params stay hashable
            # (keys in the schema's order: the model writes properties in that order)
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        object.__setattr__(
            self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids, int)
        )
        self._validate()

    def _validate(self) -> None:
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, low_open=True, high=1.0)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_int("top_k", self.top_k, low=0)
        _check_int("max_tokens", self.max_tokens, low=0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        if self.thinking_budget is not None:
            _check_int("thinking_budget", self.thinking_budget, low=0)
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingError(
                f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
            )
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise SamplingError(f"stop: every stop string must be non-empty text, got {text!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, low=0)
        self._validate_logit_bias()
        self._validate_constraint()

    def _validate_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, tuple):
            raise SamplingError(
                f"logit_bias must map token ids to biases, got {type(self.logit_bias).__name__}"
            )
        for entry in self.logit_bias:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise SamplingError(f"logit_bias entries must be (token id, bias), got {entry!r}")
            _check_int("logit_bias token id", entry[0], low=0)
            _check_number(
                f"logit_bias[{entry[0]}]", entry[1], low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS
            )
        object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias)))

    def _validate_constraint(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) > 1:
            raise SamplingError(f"give at most one of {', '.join(CONSTRAINTS)}; got {given}")
        for name in ("json_schema", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingError(f"{name} must be non-empty text, got {value!r}")
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise SamplingError(f"choice must be a list of non-empty strings, got {self.choice!r}")

    @property
    def constraint(self) -> tuple[str, str | tuple[str, ...]] | None:
        """(field name, value) of the output constraint, or None."""
        for name in CONSTRAINTS:
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        return None

    @property
    def has_penalties(self) -> bool:
        """True when a repetition, presence or frequency penalty is set (the row's logits
        then depend on the tokens before it)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def greedy(self) -> bool:
        """True when the row takes the most likely token (temperature 0, or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_generation_config(
        cls, source: str | Path | Mapping[str, Any] | None = None, **overrides: Any
    ) -> SamplingParams:
        """Defaults from a checkpoint's generation_config.json, then `overrides` on top.

        source: a checkpoint folder, a generation_config.json file, its dict, or None.
        `do_sample: false` in the config means greedy (temperature 0). Overrides set to
        None are ignored, so a server can pass request fields straight through.

        The one rule for defaults, used alike by the CLI, `LLM`, the engine and the
        server: a checkpoint without generation_config.json (a GGUF file, a folder without
        one) decodes greedily, as transformers' `generate` does with its default
        GenerationConfig (do_sample false). Pass a temperature to sample.
        """
        config = _read_generation_config(source)
        fields = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {"temperature": 0.0} if not config else {}
        values.update(checkpoint_sampling(config))
        for name, value in overrides.items():
            if name not in fields:
                raise SamplingError(f"unknown sampling parameter {name!r}")
            if value is not None:
                values[name] = value
        return cls(**values)


def checkpoint_sampling(source: str | Path | Mapping[str, Any] | None) -> dict[str, Any]:
    """The sampling fields a checkpoint's generation_config.json sets (source as for
    `SamplingParams.from_generation_config`): its temperature, top_k, top_p, min_p and
    repetition_penalty, and temperature 0 for `do_sample: false`; {} without one."""
    config = _read_generation_config(source)
    values = {
        name: config[name]
        for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
        if config.get(name) is not None
    }
    if config.get("do_sample") is False:
        values["temperature"] = 0.0
    return values


def _as_tuple(name: str, value: Any, single: type) -> tuple:
    """None -> (), one `single` value -> (value,), a list or tuple -> tuple."""
    if value is None:
        return ()
    if isinstance(value, single):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise SamplingError(f"{name} must be a list, got {type(value).__name__}")


def _check_number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise SamplingError(f"{name} must be a number, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        left = "(" if low_open else "["
        bounds = (
            f"{left}{low if low is not None else '-inf'}, {high if high is not None else 'inf'}"
        )
        bounds += "]" if high is not None else ")"
        raise SamplingError(f"{name} must be in {bounds}, got {value!r}")


def _check_int(name: str, value: Any, *, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise SamplingError(f"{name} must be {bounds}, got {value!r}")


def _read_generation_config(source: str | Path | Mapping[str, Any] | None) -> Mapping[str, Any]:
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return source
    path = Path(source)
    if path.is_dir():
        path = path / "generation_config.json"
        if not path.is_file():
            return {}
    elif path.suffix == ".gguf":
        return {}  # GGUF files carry no sampling defaults
    return read_json_object(path, SamplingError)


def make_generator(params: SamplingParams, device: str | torch.device) -> torch.Generator | None:
    """A generator seeded with `params.seed` on `device`, or None (the global RNG) without one."""
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


class LogitsProcessor(Protocol):
    """Per-request logits changes applied before the penalties (a grammar's mask).

    A processor belongs to one request: `__call__` gets that request's row of logits
    (V,) and returns it changed (it may change it in place); `accept` is told every token
    the request accepts, in order; `release` frees what it holds when the request ends
    (finished or aborted), after which it is not called again.
    """

    def __call__(self, logits: torch.Tensor) -> torch.Tensor: ...

    def accept(self, token_id: int) -> None: ...

    def release(self) -> None: ...


class LogitBias:
    """The `LogitsProcessor` of `SamplingParams.logit_bias`: adds each bias to its token's
    logit. Ids past the row's width (a head narrower than the tokenizer says) are skipped:
    no such token can be sampled."""

    def __init__(self, logit_bias: Sequence[tuple[int, float]]) -> None:
        self.ids = [token_id for token_id, _ in logit_bias]
        self.biases = [bias for _, bias in logit_bias]
        self._on: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (V,) with the biases added (in place)."""
        key = (logits.device, logits.shape[-1])
        if key not in self._on:  # built once per device and width: no copy every step
            kept = [(t, b) for t, b in zip(self.ids, self.biases, strict=True) if t < key[1]]
            ids = torch.tensor([t for t, _ in kept], dtype=torch.long, device=logits.device)
            biases = torch.tensor([b for _, b in kept], dtype=logits.dtype, device=logits.device)
            self._on[key] = (ids, biases)
        ids, biases = self._on[key]
        return logits.index_add_(0, ids, biases)

    def accept(self, token_id: int) -> None:
        pass

    def release(self) -> None:
        self._on.clear()


class ThinkingBudget:
    """The `LogitsProcessor` of `SamplingParams.thinking_budget`: once `budget` tokens were
    written inside the `<think>` block, only `</think>` may come next.

    think_open, think_close: the two tokens' ids; inside: the prompt left the block open
    (else the block opens when the first token is `<think>`, and a first token that is
    not means the model answers without thinking).
    """

    def __init__(self, budget: int, think_open: int | None, think_close: int, inside: bool):
        self.budget, self.think_open, self.think_close = budget, think_open, think_close
        self.state = "inside" if inside else "start"  # then "inside", then "done"
        self.spent = 0  # tokens written inside the block

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (V,), all but `</think>` masked once the budget is spent (in place)."""
        if self.state == "inside" and self.spent >= self.budget:
            close = logits[self.think_close].clone()
            logits.fill_(-math.inf)
            logits[self.think_close] = close if torch.isfinite(close) else 0.0
        return logits

    def accept(self, token_id: int) -> None:
        if self.state == "start":
            self.state = "inside" if token_id == self.think_open else "done"
        elif self.state == "inside":
            if token_id == self.think_close:
                self.state = "done"
            else:
                self.spent += 1

    def release(self) -> None:
        pass


@dataclass
class SampleResult:
    """The chosen tokens of one step.

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


#: Width of the slices `argmax_rows` reduces first, the vocabulary from which it does
#: (below it, one argmax pass is as fast), and the logits per thread (rows per thread x V)
#: up to which one argmax pass is still faster (see `argmax_rows`).
ARGMAX_SLICE = 1024
ARGMAX_SLICED_FROM = 32 * ARGMAX_SLICE
ARGMAX_LOGITS_PER_THREAD = 150_000


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits (B, V) -> (B,) the index of each row's maximum, the first one on ties:
    `logits.argmax(-1)`, or the same index in two cheap passes (`sliced_argmax`) where V
    is large and each thread has more than ARGMAX_LOGITS_PER_THREAD logits to scan.

    On CPU torch's argmax over a row is not vectorized (about 0.7-0.9 ns a logit, rows
    spread over the threads), while `sliced_argmax` costs about 100 us whatever B, then a
    few us per row: its dozen small ops each pay their dispatch, and between two forwards
    (where sampling runs, the CPU's caches full of the model's) that is several us an op.
    Measured there, 2 threads, AMD EPYC AVX512, median us, argmax vs sliced: SmolLM2's
    49,152 logits B=1 45 vs 112, B=2 45 vs 107, B=8 129 vs 128, B=32 476 vs 208 (one
    thread: B=2 74 vs 118, B=8 248 vs 140); Qwen3's 151,936 B=1 98 vs 88, B=2 105 vs
    104, B=4 199 vs 135.
    """
    B, V = logits.shape
    threads = torch.get_num_threads()
    if (
        logits.device.type != "cpu"
        or V < ARGMAX_SLICED_FROM
        or -(-B // threads) * V <= ARGMAX_LOGITS_PER_THREAD
    ):
        return logits.argmax(dim=-1)
    return sliced_argmax(logits)


def sliced_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits (B, V) -> (B,) `logits.argmax(-1)` in two vectorized passes: each row's
    maximum is found per slice of ARGMAX_SLICE logits (`amax`), the first slice holding
    the row's maximum is picked (argmax over B x V/1024 values), and the argmax within that
    slice (B x 1024) is the answer: the same index argmax gives, NaN included (both take
    NaN as largest). Qwen3's 151,936 logits, 8 rows, one thread: 0.2 ms against 1.2 ms
    for argmax."""
    B, V = logits.shape
    whole = V - V % ARGMAX_SLICE  # the tail past the last whole slice is a slice of its own
    maxima = logits[:, :whole].view(B, -1, ARGMAX_SLICE).amax(dim=-1)  # (B, V // slice)
    if whole < V:
        maxima = torch.cat((maxima, logits[:, whole:].amax(dim=-1, keepdim=True)), dim=1)
    starts = maxima.argmax(dim=-1) * ARGMAX_SLICE  # (B,) each row's slice
    columns = starts[:, None] + torch.arange(ARGMAX_SLICE, device=logits.device)
    # the tail's slice is short: its columns past V read the last logit again, which can
    # only be picked if that logit is the maximum (argmax keeps its first occurrence)
    window = logits.gather(1, columns.clamp_(max=V - 1))  # (B, slice)
    return starts + window.argmax(dim=-1)


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


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (to -inf), each row with its own params.

    logits: (B, V) fp32 after penalties. Returns a new (B, V) tensor; rows with temperature
    0 are left unscaled (greedy rows take the argmax, which scaling does not move).
    """
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature or 1.0 for p in params], device=device)
    logits = logits / temperature[:, None]
    if any(p.top_k > 0 for p in params):
        top_k = [p.top_k for p in params]
        widest = max(min(k or vocab, vocab) for k in top_k)  # known here: no device sync
        logits = apply_top_k(logits, torch.tensor(top_k, device=device), widest)
    if any(p.top_p < 1.0 for p in params):
        logits = apply_top_p(logits, torch.tensor([p.top_p for p in params], device=device))
    if any(p.min_p > 0.0 for p in params):
        logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
    return logits


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    prompt_lens: Sequence[int] | None = None,
) -> torch.Tensor:
    """Repetition, presence and frequency penalties (see the module docstring for who counts).

    logits: (B, V) fp32. Returns a new tensor; rows without penalties are copied unchanged.
    The rows with penalties are processed together, at the ids of their histories only
    (O(history) per row, not O(vocabulary)), without waiting on the device.
    """
    rows = [b for b, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[-1]

    def per_row(field: str) -> torch.Tensor:  # (R, 1)
        return torch.tensor([getattr(params[b], field) for b in rows], device=device)[:, None]

    index = torch.tensor(rows, device=device)
    # (R, V + 1): the rows with penalties, and a spare column that padding ids point to.
    # Several entries may name one id: they scatter the same value, so the result is defined.
    picked = torch.cat([logits[index], logits.new_zeros(len(rows), 1)], dim=1)
    seen = _padded_ids([histories[b] for b in rows], vocab, device)  # prompt and generated
    values, repetition = picked.gather(1, seen), per_row("repetition_penalty")
    picked.scatter_(1, seen, torch.where(values < 0, values * repetition, values / repetition))
    starts = [0 if prompt_lens is None else prompt_lens[b] for b in rows]
    generated = _padded_ids(
        [histories[b][start:] for b, start in zip(rows, starts, strict=True)], vocab, device
    )
    ordered = generated.sort(dim=1).values  # occurrences of each entry's id in its row:
    counts = torch.searchsorted(ordered, generated, right=True) - torch.searchsorted(
        ordered, generated
    )
    penalty = per_row("frequency_penalty") * counts + per_row("presence_penalty")
    picked.scatter_(1, generated, picked.gather(1, generated) - penalty)
    logits = logits.clone()
    logits[index] = picked[:, :vocab]
    return logits


def _padded_ids(
    histories: Sequence[Sequence[int]], vocab: int, device: torch.device | str
) -> torch.Tensor:
    """(R, longest) long: the ids of R histories, padded, with padding and ids outside the
    vocabulary replaced by `vocab` (the spare column of `apply_penalties`)."""
    width = max(1, max(len(history) for history in histories))
    ids = torch.tensor(
        [list(history) + [vocab] * (width - len(history)) for history in histories],
        dtype=torch.long,
        device=device,
    )
    return torch.where((ids >= 0) & (ids < vocab), ids, vocab)


def apply_top_k(
    logits: torch.Tensor, top_k: torch.Tensor, widest: int | None = None
) -> torch.Tensor:
    """Keep each row's top_k[b] highest logits (ties with the k-th kept); 0 = keep all.

    logits: (B, V); top_k: (B,) long. widest: the largest k of any row (0 counting as V),
    when the caller knows it on the host; otherwise it is read from the device.
    """
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)  # (B,)
    widest = int(k.max()) if widest is None else widest
    top_values = torch.topk(logits, widest, dim=-1).values  # (B, K)
    kth = top_values.gather(1, (k - 1)[:, None])  # (B, 1)
    return logits.masked_fill(logits < kth, -math.inf)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p[b].

    logits: (B, V); top_p: (B,) in (0, 1]. The most likely token is always kept.
    """
    sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # (B, V)
    drop_sorted = cumulative <= (1 - top_p)[:, None]
    drop_sorted[:, -1] = False
    drop = drop_sorted.scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, -math.inf)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p[b] times the row's top probability.

    logits: (B, V); min_p: (B,) in [0, 1].
    """
    probs = logits.softmax(dim=-1)  # (B, V)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, -math.inf)


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

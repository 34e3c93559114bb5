"""What a request asks of sampling (`SamplingParams`), checked once when it is made, and
the defaults a checkpoint's generation_config.json gives.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qinfer.core.checkpoint import read_json_object
from qinfer.core.errors import SamplingError

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

    At most one constraint on the output (see `qinfer.request.grammar`): json_schema (a dict or
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

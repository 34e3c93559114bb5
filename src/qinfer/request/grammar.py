"""Constrained decoding: a grammar as one logits processor, with `llguidance`.

A request with one of SamplingParams' constraints gets a `GrammarProcessor`:

    json_schema   the output is one JSON value valid under the schema
    regex         the whole output matches the regular expression (Rust regex syntax)
    grammar       the output is a sentence of the grammar (Lark, or llama.cpp's GBNF)
    choice        the output is exactly one of the strings

Every step, before the penalties, the processor asks its matcher (llguidance's
`LLMatcher`, which tracks the output so far against the grammar) for the set of tokens
that keep the output a valid prefix, as a bitmask over the tokenizer's vocabulary, and
sets every other logit to -inf, as well as every id past the tokenizer's own vocabulary
(a model's lm_head may be wider, Qwen3's is). The set depends only on the tokens already
accepted, so it is computed on a worker thread as soon as the previous token is accepted
(or the request is made), while the model computes the step's logits; the sampler then
only waits for it, if at all, and applies it. When the output is complete, only the
end-of-sequence ids stay allowed, so a constrained request ends with "eos" (or "length"
when max_tokens runs out first: a truncated output is the one way to get an unparsable
one). After each sampled token the matcher advances; when the request ends (finished,
aborted) it is released. A preempted engine request keeps its processor as it is: its
tokens are recomputed, never re-sampled.

JSON schemas are compiled with bounded whitespace (at most `MAX_JSON_WHITESPACE`
characters between tokens, so a model cannot pad forever) and in strict mode: an object
schema that lists `properties` without `additionalProperties` gets `false`, as OpenAI's
structured outputs require (write `"additionalProperties": true` to allow other keys).

A thinking model (Qwen3) thinks freely: no constraint inside `<think>...</think>`, the
grammar starts after it (`reasoning.prompt_thinking` says where a request starts). While the model
thinks the processor neither masks nor advances its matcher, so llguidance never sees the
thinking tokens; after `</think>` the template's "\n\n" may come before the grammar's first
token, and is not given to the matcher either. A prompt that ends with the block closed
(Qwen3's `enable_thinking=False` writes an empty one) is constrained from the first token.

An invalid constraint (a schema llguidance cannot compile, a malformed regex or
grammar) is a `SamplingError` naming the field, raised when the request is made.
"""

from __future__ import annotations

import json
import math
import os
import threading
import weakref
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np
import torch

from qinfer.core.errors import SamplingError
from qinfer.request.sampling import SamplingParams
from qinfer.text.reasoning import ANSWER, MAY_THINK, THINK_CLOSE, THINK_OPEN, THINKING
from qinfer.text.tokenizer import Tokenizer

#: The most whitespace characters a JSON output may put between two tokens.
MAX_JSON_WHITESPACE = 2
#: llguidance's `whitespace_pattern` for JSON: spaces and newlines, at most MAX_JSON_WHITESPACE.
JSON_WHITESPACE = f"[ \\n]{{0,{MAX_JSON_WHITESPACE}}}"

# Keywords whose value is a schema, a map of names to schemas, or a list of schemas.
_SCHEMA_KEYWORDS = (
    "items",
    "additionalItems",
    "additionalProperties",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
)
_SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")

# Where a request is with respect to a thinking model's `<think>...</think>` block: where
# it starts (`reasoning.prompt_thinking`: ANSWER, MAY_THINK or THINKING), then
AFTER_THINK = "after_think"  # the grammar's, or the next token of the template's separator
#: What Qwen3's template writes between `</think>` and the answer.
THINK_SEPARATOR = "\n\n"


class GrammarProcessor:
    """A `sampling.LogitsProcessor` that masks every token the grammar does not allow.

    matcher: llguidance's matcher of this request; tokenizer_vocab: the ids it knows
    (0 .. tokenizer_vocab - 1); eos_ids: allowed alone when the matcher is in error.
    phase: where the request starts (`reasoning.prompt_thinking`); think_ids: the ids of
    `<think>` and `</think>`, and separator: {id: text} of the tokens that spell a prefix
    of THINK_SEPARATOR, for a phase other than ANSWER.
    """

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        tokenizer_vocab: int,
        eos_ids: frozenset[int],
        phase: str = ANSWER,
        think_ids: tuple[int | None, int | None] = (None, None),
        separator: dict[int, str] | None = None,
    ) -> None:
        self.matcher: llguidance.LLMatcher | None = matcher
        self.tokenizer_vocab = tokenizer_vocab
        self.eos_ids = eos_ids
        self.phase = phase
        self.think_open, self.think_close = think_ids
        self.separator = separator or {}
        self._separator_left = THINK_SEPARATOR
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, tokenizer_vocab)
        self._next_mask: Future[np.ndarray] | None = None  # being computed by the worker
        _PROCESSORS.add(self)
        self._start_mask()

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        tokenizer: Tokenizer | None,
        eos_ids: frozenset[int],
        thinking: str | None = None,
    ) -> GrammarProcessor:
        """The processor of `params.constraint`, or a SamplingError naming the field;
        thinking: where the prompt leaves a thinking model (`reasoning.prompt_thinking`;
        None: no thinking), so that it holds back while the model thinks."""
        name, value = params.constraint
        if tokenizer is None:
            raise SamplingError(f"{name} needs a tokenizer; none was given")
        ll_tokenizer = _ll_tokenizer(tokenizer, eos_ids)
        matcher = llguidance.LLMatcher(ll_tokenizer, compile_constraint(name, value), log_level=0)
        if matcher.is_error():
            raise SamplingError(f"{name} is invalid: {_one_line(matcher.get_error())}")
        phase = thinking or ANSWER
        if phase == ANSWER:
            return cls(matcher, ll_tokenizer.vocab_size, eos_ids)
        think_ids = (tokenizer.token_to_id(THINK_OPEN), tokenizer.token_to_id(THINK_CLOSE))
        separator = {}
        for end in range(1, len(THINK_SEPARATOR) + 1):
            ids = tokenizer.encode(THINK_SEPARATOR[:end], add_special_tokens=False)
            if len(ids) == 1:
                separator[ids[0]] = THINK_SEPARATOR[:end]
        return cls(matcher, ll_tokenizer.vocab_size, eos_ids, phase, think_ids, separator)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (V,) with every token the grammar forbids at -inf (in place); while the
        model thinks, only the ids past the tokenizer's vocabulary."""
        known = min(self.tokenizer_vocab, logits.shape[-1])
        logits[known:] = -math.inf  # ids the tokenizer cannot produce
        if self.phase != THINKING:
            forbidden = torch.from_numpy(self._take_mask()[:known])  # (known,) bool
            logits[:known].masked_fill_(forbidden.to(logits.device), -math.inf)
        return logits

    def _start_mask(self) -> None:
        """Start computing the next step's mask on the worker thread (nothing to compute
        while the model thinks)."""
        if self.phase != THINKING and self._next_mask is None:
            self._next_mask = _mask_worker().submit(self._forbidden, self.matcher)

    def _take_mask(self) -> np.ndarray:
        """The next step's forbidden ids (tokenizer_vocab,) bool: the worker's result,
        or computed here when none was started."""
        future, self._next_mask = self._next_mask, None
        return future.result() if future is not None else self._forbidden(self.matcher)

    def _forbidden(self, matcher: llguidance.LLMatcher | None) -> np.ndarray:
        """(tokenizer_vocab,) bool, True for the ids `matcher` forbids after the tokens
        accepted so far. Runs on the worker thread; reads only state that `accept` does
        not change before this result is taken. NumPy only: a torch op large enough to
        go parallel would start a second OpenMP team on this thread, whose spinning
        threads then slow every later forward on a small machine (docs/BENCHMARKS.md,
        "A second OpenMP team")."""
        if matcher is None or matcher.is_error():
            # Cannot happen while the mask is obeyed; end the request rather than the engine.
            forbidden = np.ones(self.tokenizer_vocab, dtype=bool)
            forbidden[[t for t in self.eos_ids if t < self.tokenizer_vocab]] = False
            return forbidden
        llguidance.numpy.fill_next_token_bitmask(matcher, self._bitmask)
        forbidden = ~unpack_bitmask(self._bitmask[0], self.tokenizer_vocab)
        forbidden[self._unconstrained_ids()] = False
        return forbidden

    def _unconstrained_ids(self) -> list[int]:
        """The ids allowed besides the grammar's: `<think>` as the first token of a model
        that may think, the rest of the separator right after `</think>`."""
        if self.phase == MAY_THINK:
            return [self.think_open]
        if self.phase == AFTER_THINK:
            left = self._separator_left
            return [t for t, text in self.separator.items() if left.startswith(text)]
        return []

    def accept(self, token_id: int) -> None:
        """Advance the matcher past the sampled token (or the thinking phase past it),
        then start computing the next step's mask."""
        if self._next_mask is not None:  # the worker must be done with the matcher
            self._take_mask()
        self._advance(token_id)
        self._start_mask()

    def _advance(self, token_id: int) -> None:
        if self.phase == THINKING:
            if token_id == self.think_close:
                self.phase = AFTER_THINK
            return
        if token_id in self._unconstrained_ids():
            if self.phase == MAY_THINK:
                self.phase = THINKING
            else:
                self._separator_left = self._separator_left[len(self.separator[token_id]) :]
                self.phase = AFTER_THINK if self._separator_left else ANSWER
            return
        self.phase = ANSWER
        if self.matcher is not None:
            self.matcher.consume_token(token_id)

    def release(self) -> None:
        """Drop the matcher (the request ended), and the mask computed for it."""
        if self._next_mask is not None:
            self._next_mask.cancel()  # a mask already running finishes unread
            self._next_mask = None
        self.matcher = None


@cache
def _mask_worker() -> ThreadPoolExecutor:
    """The threads that compute masks while the model runs. llguidance's mask (and torch's
    kernels) run without Python's lock, so a mask and a forward overlap; a few threads let
    the rows of one batch compute theirs side by side."""
    return ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="qinfer-mask")


# Every processor made, weakly: `live_matchers` counts those still holding a matcher.
_PROCESSORS: weakref.WeakSet[GrammarProcessor] = weakref.WeakSet()


def live_matchers() -> int:
    """How many grammar matchers are alive now: those of running requests, plus any a
    finished request failed to release (a leak; the server reports this as a gauge)."""
    return sum(1 for processor in list(_PROCESSORS) if processor.matcher is not None)


def unpack_bitmask(words: np.ndarray, size: int) -> np.ndarray:
    """A bitmask (W,) int32, bit j of word i for id 32 i + j, as (size,) bool (the words'
    bytes read little-endian, as they lie in memory on every host we run on)."""
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")  # (32 W,)
    return bits[:size].astype(bool)


def compile_constraint(name: str, value: str | tuple[str, ...]) -> str:
    """llguidance's grammar text for one of SamplingParams' constraints (see the module
    docstring); a SamplingError naming the field when it cannot be read."""
    try:
        if name == "json_schema":
            schema = json.loads(value)
            if not isinstance(schema, dict):
                raise SamplingError(f"json_schema must be a JSON object, got {value!r}")
            cycle = ref_cycle(schema)
            if cycle is not None:
                raise SamplingError(
                    f"json_schema is invalid: $ref {' -> '.join(cycle)} refers back to "
                    "itself before describing any value"
                )
            return llguidance.LLMatcher.grammar_from_json_schema(
                strict_schema(schema), defaults={"whitespace_pattern": JSON_WHITESPACE}
            )
        if name == "choice":
            return llguidance.grammar_from("choice", list(value))
        return llguidance.grammar_from("grammar" if name == "grammar" else "regex", value)
    except (ValueError, TypeError) as error:  # json's and llguidance's parse errors
        raise SamplingError(f"{name} is invalid: {_one_line(str(error))}") from None


def json_schema_problem(schema: dict[str, Any]) -> str | None:
    """Why llguidance cannot constrain JSON to `schema`, in one line, or None when it can."""
    try:
        grammar = compile_constraint("json_schema", json.dumps(schema))
    except SamplingError as error:
        return str(error).removeprefix("json_schema is invalid: ")
    problem = llguidance.LLMatcher.validate_grammar(grammar, None)
    return _one_line(problem) if problem.strip() else None


def strict_schema(schema: Any) -> Any:
    """A copy of a JSON schema in which every object schema that lists `properties`
    without `additionalProperties` gets `"additionalProperties": false` (a bare
    `{"type": "object"}` still means any object)."""
    return _with_additional_properties(schema, False)


def lenient_schema(schema: Any) -> Any:
    """A copy of a JSON schema in which every object schema that lists `properties`
    without `additionalProperties` gets `true`, JSON Schema's own default, written out so
    that strict mode leaves it open (OpenAI's `strict: false`)."""
    return _with_additional_properties(schema, True)


def _with_additional_properties(schema: Any, allowed: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = allowed
    for key in _SCHEMA_KEYWORDS:
        if isinstance(schema.get(key), dict):
            out[key] = _with_additional_properties(schema[key], allowed)
    for key in _SCHEMA_MAP_KEYWORDS:
        if isinstance(schema.get(key), dict):
            out[key] = {
                name: _with_additional_properties(sub, allowed) for name, sub in schema[key].items()
            }
    for key in _SCHEMA_LIST_KEYWORDS:
        if isinstance(schema.get(key), list):
            out[key] = [_with_additional_properties(sub, allowed) for sub in schema[key]]
    return out


# Keywords whose schemas apply to the same value as the schema holding them.
_SAME_VALUE_KEYWORDS = ("allOf", "anyOf", "oneOf")


def ref_cycle(schema: dict[str, Any]) -> list[str] | None:
    """A chain of local `$ref`s that leads back to its start while still describing the
    same value (`{"$ref": "#"}`, two definitions naming each other), or None. Such a
    schema never says what the value is; llguidance compiles it and then fails at the
    first token. Recursion through properties or items (a tree) is fine."""

    def resolve(ref: str) -> Any:
        node: Any = schema
        for part in ref.removeprefix("#").split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def follow(node: Any, chain: list[str]) -> list[str] | None:
        if not isinstance(node, dict):
            return None
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            if ref in chain:
                return [*chain, ref]
            found = follow(resolve(ref), [*chain, ref])
            if found is not None:
                return found
        for key in _SAME_VALUE_KEYWORDS:
            for sub in node.get(key) if isinstance(node.get(key), list) else ():
                found = follow(sub, chain)
                if found is not None:
                    return found
        return None

    def nodes(value: Any):
        if isinstance(value, dict):
            yield value
            for item in value.values():
                yield from nodes(item)
        elif isinstance(value, list):
            for item in value:
                yield from nodes(item)

    return next((c for node in nodes(schema) if (c := follow(node, [])) is not None), None)


def _one_line(message: str) -> str:
    """llguidance's multi-line message (with a caret diagram) as one line."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip()) or "unknown"


# llguidance's view of a tokenizer takes ~0.2 s to build (longer for 150k vocabularies):
# built once per tokenizer and set of EOS ids.
_LL_TOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, dict] = weakref.WeakKeyDictionary()
_LL_TOKENIZERS_LOCK = threading.Lock()


def _ll_tokenizer(tokenizer: Tokenizer, eos_ids: Iterable[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer over the same `tokenizers` pipeline and vocabulary (added
    tokens included), ending on `eos_ids`."""
    eos = tuple(sorted(eos_ids))
    with _LL_TOKENIZERS_LOCK:
        built = _LL_TOKENIZERS.setdefault(tokenizer, {})
        if eos not in built:
            built[eos] = llguidance.LLTokenizer(
                tokenizer.backend.to_str(),
                n_vocab=tokenizer.vocab_size,
                eos_token=list(eos) or None,
            )
        return built[eos]

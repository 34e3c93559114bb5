"""JSON text that may stop anywhere: whether it can still become a known value
(`may_become`, which lets the parser hold back a call that may repeat an earlier one),
and where one value ends in streamed text (`ValueScanner`)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any


def same_json(a: Any, b: Any) -> bool:
    """Whether two parsed JSON values are the same: key order aside, but 1 is neither
    1.0 nor true (Python's == would say they are)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def may_become(text: str, value: Any) -> bool:
    """Whether JSON `text`, which may stop anywhere, can still turn out to be `value` (as
    `same_json` compares); a float still being written counts as yes (`1` may become
    `1.5` or `15e-1`), since the caller then only waits longer. A key written twice
    counts as a difference."""
    try:
        _PartialJSON(text).value(value)
    except _Differs:
        return False
    except _TextEnded:
        pass
    return True


class _Differs(Exception):
    """The JSON read so far is not the expected value's."""


class _TextEnded(Exception):
    """The text stops inside the value: what follows may still make it the expected one."""


#: A string's text up to its closing quote (escapes whole), an escape still being
#: written, a number's or a literal's characters.
_STRING_BODY = re.compile(r'(?:[^"\\]|\\u[0-9a-fA-F]{4}|\\[^u])*')
_PARTIAL_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{0,3})?")
_SCALAR = re.compile(r"[-+.\w]*")
_LITERALS = ("true", "false", "null")


class _PartialJSON:
    """Reads JSON text that may stop anywhere against an expected value (`may_become`):
    `value` returns when the value is whole and the expected one, or raises _Differs or
    _TextEnded."""

    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def value(self, expected: Any) -> None:
        char = self._next()
        if char == "{":
            self._object(expected)
        elif char == "[":
            self._array(expected)
        elif char == '"':
            if not isinstance(expected, str):
                raise _Differs
            self._string_among([expected])
        else:
            self._scalar(expected)

    def _object(self, expected: Any) -> None:
        if not isinstance(expected, dict):
            raise _Differs
        missing = dict(expected)  # the keys not read yet
        char = self._next()
        while char != "}":
            if char != '"':
                raise _Differs
            key = self._string_among(missing)
            if self._next() != ":":
                raise _Differs
            self.value(missing.pop(key))
            char = self._next()
            if char == ",":
                char = self._next()
            elif char != "}":
                raise _Differs
        if missing:
            raise _Differs

    def _array(self, expected: Any) -> None:
        if not isinstance(expected, list):
            raise _Differs
        for i, item in enumerate(expected):
            self.value(item)
            if self._next() != ("]" if i == len(expected) - 1 else ","):
                raise _Differs
        if not expected and self._next() != "]":
            raise _Differs

    def _string_among(self, candidates: Iterable[str]) -> str:
        """A string (read from after its opening quote) that must be one of `candidates`:
        its text, or _TextEnded while it may still become one."""
        body = _STRING_BODY.match(self.text, self.at)
        self.at, rest = body.end(), self.text[body.end() :]
        try:
            text = json.loads(f'"{body.group()}"')
        except json.JSONDecodeError:  # an unknown escape, a raw control character
            raise _Differs from None
        if rest.startswith('"'):
            self.at += 1
            if text in candidates:
                return text
            raise _Differs
        if rest and not _PARTIAL_ESCAPE.fullmatch(rest):  # else: an escape being written
            raise _Differs
        if text[-1:] and "\ud800" <= text[-1] <= "\udbff":  # half of a surrogate pair
            text = text[:-1]
        if any(candidate.startswith(text) for candidate in candidates):
            raise _TextEnded
        raise _Differs

    def _scalar(self, expected: Any) -> None:
        word = _SCALAR.match(self.text, self.at - 1).group()
        self.at += len(word) - 1
        if self.at == len(self.text):  # the scalar may go on
            if _may_start(word, expected):
                raise _TextEnded
            raise _Differs
        try:
            value = json.loads(word)
        except json.JSONDecodeError:
            raise _Differs from None
        if not same_json(value, expected):
            raise _Differs

    def _next(self) -> str:
        """The next character past whitespace (read); _TextEnded at the text's end."""
        while self.at < len(self.text) and self.text[self.at] in " \t\n\r":
            self.at += 1
        if self.at == len(self.text):
            raise _TextEnded
        self.at += 1
        return self.text[self.at - 1]


def _may_start(word: str, value: Any) -> bool:
    """Whether a scalar's first characters can still become `value`: an integer is
    written one way (`-0` aside), a float many (`1.5`, `15e-1`), a literal one way."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value).startswith(word) or (value == 0 and "-0".startswith(word))
    if isinstance(value, float):
        return word[:1] in "-0123456789"
    return any(lit.startswith(word) and same_json(json.loads(lit), value) for lit in _LITERALS)


class ValueScanner:
    """Finds where one JSON value ends in streamed text: tracks strings and nesting,
    nothing more (the grammar, or the caller, checks the rest)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = self.started = self.done = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the value (all, until it ends)."""
        for i, char in enumerate(text):
            if self.done:
                return i
            if not self.started:
                if char.isspace():
                    continue
                self.started = True
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    self.done = self.depth == 0
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                if self.depth == 0:  # a bare value ends at its object's brace
                    self.done = True
                    return i
                self.depth -= 1
                self.done = self.depth <= 0
            elif self.depth == 0 and char == ",":
                self.done = True
                return i
        return len(text)

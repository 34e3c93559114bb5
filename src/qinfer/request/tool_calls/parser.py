"""The streaming parser that splits a reply into content and tool-call deltas.

`ToolCallParser` turns the streamed reply into content and call deltas: text goes out as
content except a tail that may be the start of a tag. A call whose syntax a grammar
forces (`grammar.tool_call_grammar`) goes out as soon as its header `{"name": "...",
"arguments": ` is read (its id and name once), then its arguments as they arrive; one
whose arguments the reply's end (max_tokens, a stop string) cuts is marked
(`ParsedDelta.cut_call`), and a whole answer leaves it out (a stream has sent its
fragments already; its finish_reason "length" says the last call is cut); the start of
a call cut before its arguments is dropped (a forced reply holds nothing else). An
unforced call (`tool_choice` "auto") goes out when its block ends and parses whole as a
call of an offered tool; any other block (malformed JSON, an unknown tool) is returned
as content, as written.

A call identical to one the reply made already (same name, same arguments as parsed
JSON) ends the reply: a small model under a grammar that allows several calls tends to
write its call again and again until max_tokens. The repeat is never handed out: a
forced call that names an earlier call's tool is held back (its id, name and arguments
so far) while its arguments may still turn out to be that call's (`partial_json`), and
goes out as soon as they differ; once a repeat's arguments are complete,
`ToolCallParser.repeated` tells the caller to stop generating, and the reply is over (it
ends as one that made calls).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from qinfer.request.tool_calls.formats import (
    PYTHON_TAG,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCallFormat,
)
from qinfer.request.tool_calls.partial_json import ValueScanner, may_become, same_json
from qinfer.text.detokenizer import partial_match_length


@dataclass
class ToolCallDelta:
    """What one stretch of a reply adds to the call at `index`: its id and name the
    first time, then fragments of its arguments (each API writes it in its own shape)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    """The content and tool-call deltas of one stretch of a reply; cut_call: the index of
    a call whose arguments the reply's end cut (max_tokens), set by `finish`."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    cut_call: int | None = None


# Where the parser is: in plain text, in a call whose header is not yet read, in its
# arguments, after them (until the block closes), past a repeated call (the reply is over).
_TEXT, _BLOCK, _ARGUMENTS, _AFTER, _OVER = "text", "block", "arguments", "after", "over"


class ToolCallParser:
    """Splits a streamed reply into content and tool-call deltas (module docstring).

    tool_names: the tools offered; a call naming another is content. forced: a grammar
    forces the calls' syntax, so they stream from their header on (else each call waits
    for its block's end, to be checked whole).
    `push(text)` and `finish()` return a ParsedDelta; `push` may hold text back. Once
    `repeated` is true (the reply wrote one of its calls again), the rest is ignored.
    """

    def __init__(self, fmt: ToolCallFormat, tool_names: Sequence[str], forced: bool) -> None:
        self.fmt, self.tool_names, self.forced = fmt, frozenset(tool_names), forced
        self.num_calls = 0  # calls opened (each call's index), a cut one included
        self.repeated = False  # the reply wrote one of its calls again: it is over
        self._made: list[tuple[str, Any]] = []  # (name, arguments; None: unparsable) per call
        self._name, self._arguments = "", ""  # the open call's name and arguments so far
        self._holding: ToolCallDelta | None = None  # the open call, held: it may be a repeat
        self._state = _TEXT
        self._after_call = False  # a call was made and no text has come since
        self._held = ""  # text not yet handed out
        self._block = ""  # the current block's text (after its opening tag)
        self._started = False  # the untagged format: the reply's first character was read
        self._header = re.compile(
            r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"'
            + re.escape(fmt.arguments_key)
            + r'"\s*:\s*(?=\S)'  # through the first character of the arguments
        )
        self._scan = ValueScanner()
        self._steps = {
            _TEXT: self._in_text,
            _BLOCK: self._in_block,
            _ARGUMENTS: self._in_arguments,
            _AFTER: self._in_after,
            _OVER: self._in_over,
        }

    def push(self, text: str) -> ParsedDelta:
        """The content and call deltas that the reply's next `text` completes."""
        self._held += text
        out = ParsedDelta()
        while True:  # one delta may cross several states
            state, held = self._state, self._held
            self._steps[state](out)
            if self._state == state and self._held == held:
                return out

    @property
    def made_calls(self) -> bool:
        """Whether the reply made a call (a whole one: not one the reply's end cut)."""
        return bool(self._made)

    def finish(self) -> ParsedDelta:
        """The end of the reply: what was held, or a pending block, goes out; but in a
        forced reply, whose text can only be calls, what the end cut (a call's start, a
        call held back as a possible repeat) was never sent and is dropped."""
        out = self.push("")
        if self._state == _ARGUMENTS and self._holding is None:
            out.cut_call = self.num_calls - 1  # its fragments are out: not a call to run
        elif not self.forced and self._state == _BLOCK:
            self._close_block(self._block + self._held, out, closed=False)
        elif not self.forced and self._state == _TEXT:
            out.content += self._held
        self._held, self._state, self._holding = "", _TEXT, None
        return out

    # -- the states -------------------------------------------------------------------

    def _in_text(self, out: ParsedDelta) -> None:
        if self._after_call:  # the newlines between and after calls are no content
            self._held = self._held.lstrip()
            self._after_call = not self._held
        if not self.fmt.tagged:
            self._untagged_start(out)
            return
        start = self._held.find(TOOL_CALL_OPEN)
        if start >= 0:
            out.content += self._held[:start]
            self._held = self._held[start + len(TOOL_CALL_OPEN) :]
            self._block, self._state = "", _BLOCK
            return
        keep = partial_match_length(self._held, [TOOL_CALL_OPEN])
        out.content += self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]

    def _untagged_start(self, out: ParsedDelta) -> None:
        """A bare-JSON call is the whole reply: decide from its first characters."""
        if self._started:
            out.content, self._held = out.content + self._held, ""
            return
        head = self._held.lstrip()
        if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
            return  # not yet known
        self._started = True
        call = head.removeprefix(PYTHON_TAG).lstrip()
        if call.startswith("{") or not call:
            self._held, self._block, self._state = call, "", _BLOCK
        else:
            out.content, self._held = out.content + self._held, ""

    def _in_block(self, out: ParsedDelta) -> None:
        self._block, self._held = self._block + self._held, ""
        end = self._block.find(TOOL_CALL_CLOSE) if self.fmt.tagged else -1
        header = self._header.match(self._block) if self.forced else None
        if header and (end < 0 or header.end() <= end):
            name = json.loads(header.group(1))
            if name in self.tool_names:
                call = self._open_call(name)
                if self._may_repeat(name, ""):
                    self._holding = call
                else:
                    out.tool_calls.append(call)
                self._held, self._state = self._block[header.end() :], _ARGUMENTS
                self._name, self._arguments, self._scan = name, "", ValueScanner()
                return
        if end >= 0:
            block = self._block[:end]
            self._held, self._state = self._block[end + len(TOOL_CALL_CLOSE) :], _TEXT
            self._close_block(block, out, closed=True)

    def _in_arguments(self, out: ParsedDelta) -> None:
        end = self._held.find(TOOL_CALL_CLOSE) if self.fmt.tagged else -1
        scanned = self._held if end < 0 else self._held[:end]
        length = self._scan.feed(scanned)
        if length:
            self._add_arguments(scanned[:length], out)
        self._held = self._held[length:]
        if self._scan.done:
            self._state = _AFTER
            self._call_made(out)
        elif end >= 0:  # the block closed inside the arguments: they stay as written
            self._held, self._state = self._held[end - length + len(TOOL_CALL_CLOSE) :], _TEXT
            self._call_made(out)

    def _in_after(self, out: ParsedDelta) -> None:
        """After the arguments: skip to the end of the block (`}` then the closing tag)."""
        if not self.fmt.tagged:
            brace = self._held.find("}")
            if brace >= 0:
                self._held, self._state = self._held[brace + 1 :], _TEXT
            return
        end = self._held.find(TOOL_CALL_CLOSE)
        if end >= 0:
            self._held, self._state = self._held[end + len(TOOL_CALL_CLOSE) :], _TEXT

    def _in_over(self, out: ParsedDelta) -> None:
        """Past a repeated call: the reply is over, whatever the model still writes."""
        self._held = ""

    # -- calls --------------------------------------------------------------------------

    def _open_call(self, name: str) -> ToolCallDelta:
        self.num_calls += 1
        self._after_call = True
        return ToolCallDelta(self.num_calls - 1, id=f"call_{uuid.uuid4().hex[:24]}", name=name)

    def _add_arguments(self, text: str, out: ParsedDelta) -> None:
        """More of the open call's arguments: out, or held with the call while it may
        still repeat an earlier one (all of it goes out once it cannot)."""
        self._arguments += text
        if self._holding is None:
            out.tool_calls.append(ToolCallDelta(self.num_calls - 1, arguments=text))
            return
        self._holding.arguments += text
        if not self._may_repeat(self._name, self._arguments):
            out.tool_calls.append(self._holding)
            self._holding = None

    def _call_made(self, out: ParsedDelta) -> None:
        """The open call's arguments ended: a repeat ends the reply, any other call is
        made (and goes out, if it was held)."""
        arguments = _json_or_none(self._arguments)
        if self._repeats(self._name, arguments):
            self._holding = None
            self._end_repeated()
            return
        if self._holding is not None:
            out.tool_calls.append(self._holding)
            self._holding = None
        self._made.append((self._name, arguments))

    def _repeats(self, name: str, arguments: Any) -> bool:
        """Whether a call of `name` with these (parsed) arguments is one made already."""
        return arguments is not None and any(
            made == name and same_json(args, arguments) for made, args in self._made
        )

    def _may_repeat(self, name: str, arguments: str) -> bool:
        """Whether a call of `name` whose arguments start with this text may still turn
        out to be one made already."""
        return any(
            made == name and args is not None and may_become(arguments, args)
            for made, args in self._made
        )

    def _end_repeated(self) -> None:
        self.repeated, self._held, self._state = True, "", _OVER

    def _close_block(self, block: str, out: ParsedDelta, closed: bool) -> None:
        """A block whose header did not parse: a call if it parses whole (a repeat ends
        the reply), else content."""
        call = _parse_call(block, self.fmt.arguments_key)
        if call is not None and call[0] in self.tool_names:
            if self._repeats(*call):
                self._end_repeated()
                return
            delta = self._open_call(call[0])
            delta.arguments = json.dumps(call[1], ensure_ascii=False)
            out.tool_calls.append(delta)
            self._made.append(call)
            return
        if self.fmt.tagged:
            block = TOOL_CALL_OPEN + block + (TOOL_CALL_CLOSE if closed else "")
        out.content += block


def _parse_call(text: str, arguments_key: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one whole call's JSON, or None when it is not one. Arguments
    are an object, as OpenAI's are; some models write it as JSON text, decoded here."""
    value = _json_or_none(text)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters")))
    if isinstance(arguments, str):
        arguments = _json_or_none(arguments)
    return (value["name"], arguments) if isinstance(arguments, dict) else None


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None

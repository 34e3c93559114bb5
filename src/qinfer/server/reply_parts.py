"""A reply as the parts the Responses and Messages APIs show: reasoning, text, tool calls.

Chat completions stream one flat delta per step (some reasoning, some content, some call
fragments). The Responses API (output items) and the Messages API (content blocks) show a
reply as a sequence of parts instead, each opened, filled and closed in turn:

    reasoning   Qwen3's `<think>` block           Responses: a `reasoning` item;
                                                  Messages: a `thinking` block
    text        the answer's content              a `message` item / a `text` block
    call        one tool call (id, name, then     a `function_call` item / a `tool_use` block
                its arguments as they arrive)

A part opens when text of another kind arrives (text after a call opens a second text
part), so the parts keep the order in which the model wrote them. Whole answers are built
from the same events as streams, so the two always agree, but for a call whose arguments
the reply's end cut (`Part.cut`): a stream has shown it already and closes it, a whole
answer leaves it out (its arguments do not parse, and it is no call to run).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from qinfer.server.choices import Completion, Delta
from qinfer.server.errors import APIError, error_from_exception
from qinfer.server.streaming import named_sse_event

PartKind = Literal["reasoning", "text", "call"]


@dataclass
class Part:
    """One part of a reply. text: the reasoning, the text, or a call's arguments so far;
    call_id and name: a call's; cut: a call whose arguments the reply's end cut."""

    kind: PartKind
    index: int  # its position among the reply's parts
    text: str = ""
    call_id: str | None = None
    name: str | None = None
    cut: bool = False


@dataclass(frozen=True)
class PartEvent:
    """A part opened, `text` added to it, or the part closed (`final`: the reply's last
    part, closed when the reply ended). The part is the live one: its `text` is whole
    only once it closed."""

    action: Literal["open", "add", "close"]
    part: Part
    text: str = ""
    final: bool = False


class ReplyParts:
    """Turns one choice's deltas into part events; `parts` holds the reply so far."""

    def __init__(self) -> None:
        self.parts: list[Part] = []
        self._open: Part | None = None
        self._calls: dict[int, Part] = {}  # the parser's call index -> its part

    @property
    def made_calls(self) -> bool:
        """Whether the reply made a call (a whole one: not one its end cut)."""
        return any(not part.cut for part in self._calls.values())

    def push(self, delta: Delta) -> list[PartEvent]:
        """The events of one delta (in a delta, reasoning comes before content, and
        content before the calls it precedes)."""
        events: list[PartEvent] = []
        if delta.reasoning:
            self._add("reasoning", delta.reasoning, events)
        if delta.content:
            self._add("text", delta.content, events)
        for call in delta.tool_calls:
            if call.id is not None:  # a new call: its id and name come once, first
                part = self._start("call", events, call_id=call.id, name=call.name)
                self._calls[call.index] = part
            if call.arguments:
                part = self._calls[call.index]
                part.text += call.arguments
                events.append(PartEvent("add", part, call.arguments))
        if delta.cut_call is not None:
            self._calls[delta.cut_call].cut = True
        return events

    def finish(self) -> list[PartEvent]:
        """The end of the reply: the open part closes."""
        events: list[PartEvent] = []
        self._close(events, final=True)
        return events

    def _add(self, kind: PartKind, text: str, events: list[PartEvent]) -> None:
        part = self._open if self._open is not None and self._open.kind == kind else None
        if part is None:
            part = self._start(kind, events)
        part.text += text
        events.append(PartEvent("add", part, text))

    def _start(self, kind: PartKind, events: list[PartEvent], **fields: str | None) -> Part:
        self._close(events)
        part = Part(kind, len(self.parts), **fields)
        self.parts.append(part)
        self._open = part
        events.append(PartEvent("open", part))
        return part

    def _close(self, events: list[PartEvent], final: bool = False) -> None:
        if self._open is not None:
            events.append(PartEvent("close", self._open, final=final))
            self._open = None


class PartsFormat:
    """How an API that shows replies as parts answers one request (a single choice):
    subclasses say what each event and the whole answer look like; this drives them.

    Every event payload carries its `type`, which names its server-sent event.
    """

    def opening_events(self, completion: Completion) -> list[dict[str, Any]]:
        """The events before any part (the response or message announced)."""
        raise NotImplementedError

    def part_events(self, event: PartEvent, completion: Completion) -> list[dict[str, Any]]:
        """The events that show one part event."""
        raise NotImplementedError

    def closing_events(self, completion: Completion, reply: ReplyParts) -> list[dict[str, Any]]:
        """The events after the last part (how the reply ended, its usage)."""
        raise NotImplementedError

    def error_events(self, error: APIError, completion: Completion) -> list[dict[str, Any]]:
        """The events of a failure after the stream started (its status is sent already)."""
        raise NotImplementedError

    def answer(self, completion: Completion, reply: ReplyParts) -> dict[str, Any]:
        """The whole answer of a finished reply."""
        raise NotImplementedError

    def sse(self, payload: dict[str, Any]) -> str:
        """One event as sent."""
        return named_sse_event(payload)

    async def whole(self, completion: Completion) -> dict[str, Any]:
        """Run the reply to its end; its whole answer. Cancelling this (the client left)
        closes the deltas at once, which aborts the engine request."""
        reply = ReplyParts()
        async with contextlib.aclosing(completion.deltas()) as deltas:
            async for delta in deltas:
                reply.push(delta)
        reply.finish()
        return self.answer(completion, reply)

    async def events(
        self, completion: Completion, first: Delta, rest: AsyncIterator[Delta], include_usage: bool
    ) -> AsyncIterator[str]:
        """The server-sent events of a stream whose first delta is already known (the
        usage always comes with the closing events, whatever `include_usage` says)."""
        reply = ReplyParts()
        try:
            for payload in self.opening_events(completion):
                yield self.sse(payload)
            async for delta in _prepend(first, rest):
                for payload in self._shown(reply.push(delta), completion):
                    yield self.sse(payload)
            finishing = self._shown(reply.finish(), completion)
            for payload in [*finishing, *self.closing_events(completion, reply)]:
                yield self.sse(payload)
        except Exception as error:
            for payload in self.error_events(error_from_exception(error), completion):
                yield self.sse(payload)
        finally:
            await rest.aclose()

    def _shown(self, events: list[PartEvent], completion: Completion) -> list[dict[str, Any]]:
        return [payload for event in events for payload in self.part_events(event, completion)]


async def _prepend(first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    yield first
    async for delta in rest:
        yield delta

"""Server-sent events: one `data: <json>` event per chunk, then `data: [DONE]` (chat and
text completions), or named events `event: <type>` / `data: <json>` (the Responses and
Messages APIs, whose clients dispatch on the name).

A client may leave in the middle of a stream. The response below closes its event source
whatever way the stream ends, so the source's own `finally` (which aborts the request in
the engine and frees its KV blocks) always runs, and runs at once.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

#: The event that ends every OpenAI stream.
DONE_EVENT = "data: [DONE]\n\n"


def sse_event(payload: dict) -> str:
    """One server-sent event carrying `payload` as compact JSON on a single `data:` line."""
    # json.dumps escapes newlines inside strings, so the event can never be split.
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def named_sse_event(payload: dict) -> str:
    """One server-sent event named after `payload["type"]`, carrying `payload`."""
    return f"event: {payload['type']}\n{sse_event(payload)}"


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response over an async generator of events.

    Starlette stops iterating when the client disconnects but leaves the generator
    suspended; closing it here runs its cleanup while the request is still ours.
    """

    def __init__(self, events: AsyncIterator[str]):
        super().__init__(
            events,
            media_type="text/event-stream",
            # No proxy buffering, no caching: each event must reach the client as it is made.
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()

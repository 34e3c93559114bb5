"""The soak of `qinfer serve`: many requests of every API at once, and what they leave behind.

`python bench/load_server.py --soak N` sends N requests drawn in turn from `KINDS`: chat
completions (streamed, and whole with tools), the Responses API (whole, streamed, and a
chain of two through `previous_response_id`), Anthropic Messages (whole and streamed, with
tool_use / tool_result blocks in the history and tools offered, some forcing a call),
embeddings, and streams each client drops after its first event (chat, Responses,
Messages; some inside a forced call's grammar). A chain counts as two requests.

It reports the requests per kind, HTTP statuses (5xx: the server's fault; any 4xx is a
bug of this mix), transport errors, and, once the server is idle, what should be back to
zero: running and waiting requests, KV blocks in use, live grammar matchers (the
server's /metrics); the aborted requests counted; the server's RSS (when this run started
it) after warm-up, halfway and at the end.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import httpx

WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
        "required": ["city"],
    },
}
CHAT_TOOLS = [{"type": "function", "function": WEATHER}]
RESPONSES_TOOLS = [{"type": "function", **WEATHER}]
ANTHROPIC_TOOLS = [
    {
        "name": WEATHER["name"],
        "description": WEATHER["description"],
        "input_schema": WEATHER["parameters"],
    }
]
#: An Anthropic conversation that already called the tool and got its result.
ANTHROPIC_HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look."},
            {
                "type": "tool_use",
                "id": "toolu_1",
                "name": "get_weather",
                "input": {"city": "Paris"},
            },
        ],
    },
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny."}],
    },
]
USER = [{"role": "user", "content": "Tell me about the sea."}]


class Soak:
    """One soak's client and tallies: statuses by code, requests by kind, errors."""

    def __init__(self, client: httpx.AsyncClient, model: str, max_tokens: int) -> None:
        self.client, self.model, self.max_tokens = client, model, max_tokens
        self.statuses: Counter[int] = Counter()
        self.kinds: Counter[str] = Counter()
        self.errors: list[str] = []

    def note(self, response: httpx.Response, body: bytes = b"") -> None:
        self.statuses[response.status_code] += 1
        if response.status_code != 200 and len(self.errors) < 5:
            self.errors.append(f"{response.request.url.path} {response.status_code} {body[:200]!r}")

    async def post(self, path: str, body: dict) -> dict | None:
        """A whole request; its JSON when it answered 200."""
        response = await self.client.post(path, json={"model": self.model, **body})
        self.note(response, response.content)
        return response.json() if response.status_code == 200 else None

    async def stream(self, path: str, body: dict, drop: bool = False) -> list[str]:
        """A streamed request read to its end (or left after its first event: `drop`);
        its `data:` lines."""
        body = {"model": self.model, "stream": True, **body}
        lines: list[str] = []
        async with self.client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                self.note(response, await response.aread())
                return lines
            self.note(response)
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line[len("data: ") :])
                    if drop:
                        break
        return lines

    # -- the kinds --------------------------------------------------------------------

    async def chat_stream(self) -> None:
        await self.stream("/v1/chat/completions", {"messages": USER, "max_tokens": self.max_tokens})

    async def chat_tools(self) -> None:
        body = {"messages": USER, "tools": CHAT_TOOLS, "max_tokens": self.max_tokens}
        await self.post("/v1/chat/completions", body)

    async def responses_whole(self) -> None:
        await self.post(
            "/v1/responses", {"input": "Name a colour.", "max_output_tokens": self.max_tokens}
        )

    async def responses_stream(self) -> None:
        body = {
            "input": "Name a fruit.",
            "tools": RESPONSES_TOOLS,
            "max_output_tokens": self.max_tokens,
        }
        await self.stream("/v1/responses", body)

    async def responses_chain(self) -> None:
        first = await self.post(
            "/v1/responses", {"input": "Hi.", "max_output_tokens": self.max_tokens}
        )
        if first is not None:
            body = {"input": "And then?", "previous_response_id": first["id"]}
            await self.stream("/v1/responses", {**body, "max_output_tokens": self.max_tokens})

    async def messages_whole(self) -> None:
        body = {
            "messages": ANTHROPIC_HISTORY,
            "tools": ANTHROPIC_TOOLS,
            "max_tokens": self.max_tokens,
        }
        await self.post("/v1/messages", body)

    async def messages_stream(self) -> None:
        body = {"messages": ANTHROPIC_HISTORY, "tools": ANTHROPIC_TOOLS, "max_tokens": 64}
        await self.stream("/v1/messages", {**body, "tool_choice": {"type": "any"}})

    async def embeddings(self) -> None:
        await self.post("/v1/embeddings", {"input": ["a lighthouse", "the sea at night"]})

    async def dropped_chat(self) -> None:
        body = {"messages": USER, "tools": CHAT_TOOLS, "tool_choice": "required", "max_tokens": 64}
        await self.stream("/v1/chat/completions", body, drop=True)

    async def dropped_responses(self) -> None:
        body = {"input": "Tell me a story.", "max_output_tokens": 64}
        await self.stream("/v1/responses", body, drop=True)

    async def dropped_messages(self) -> None:
        body = {"messages": USER, "max_tokens": 64}
        await self.stream("/v1/messages", body, drop=True)


#: The mix, drawn in turn (a chain is two requests).
KINDS: list[str] = [
    "chat_stream",
    "chat_tools",
    "responses_whole",
    "responses_stream",
    "responses_chain",
    "messages_whole",
    "messages_stream",
    "embeddings",
    "dropped_chat",
    "dropped_responses",
    "dropped_messages",
]


async def idle_metrics(client: httpx.AsyncClient, timeout: float = 60) -> dict[str, float]:
    """The server's unlabelled /metrics once nothing runs, waits or holds a KV block (or at
    `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        text = (await client.get("/metrics")).text
        values = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name.startswith("qinfer_") and "{" not in name and value:
                values[name] = float(value)
        busy = values.get("qinfer_requests_running", 0) + values.get("qinfer_requests_waiting", 0)
        if (not busy and not values.get("qinfer_kv_blocks_used")) or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.1)


def rss_mb(pid: int | None) -> float | None:
    """A process's resident memory in MB (Linux /proc), or None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as status:
            line = next(line for line in status if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 1024


async def soak(
    url: str,
    headers: dict[str, str],
    requests: int,
    concurrency: int,
    max_tokens: int,
    timeout: float,
    server_pid: int | None,
) -> dict:
    """Send `requests` requests of the mix, `concurrency` at once; the report (module
    docstring)."""
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=timeout, limits=limits
    ) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        run = Soak(client, model, max_tokens)
        for kind in KINDS:  # warm-up: one of each, so the first RSS is after it
            await getattr(run, kind)()
        before = await idle_metrics(client)
        rss = {"start": rss_mb(server_pid)}
        run.statuses.clear()
        sent, drawn, transport_errors = 0, 0, Counter()
        halfway = asyncio.Event()

        async def worker() -> None:
            nonlocal sent, drawn
            while sent < requests:
                kind, drawn = KINDS[drawn % len(KINDS)], drawn + 1
                sent += 2 if kind == "responses_chain" else 1
                run.kinds[kind] += 1
                if sent >= requests // 2 and not halfway.is_set():
                    halfway.set()
                    rss["middle"] = rss_mb(server_pid)
                call: Callable[[], Awaitable[None]] = getattr(run, kind)
                try:
                    await call()
                except httpx.HTTPError as error:
                    transport_errors[type(error).__name__] += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
        after = await idle_metrics(client)
        rss["end"] = rss_mb(server_pid)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    return {
        "requests": sum(run.statuses.values()),
        "seconds": seconds,
        "requests_per_s": sum(run.statuses.values()) / seconds,
        "kinds": dict(run.kinds),
        "statuses": dict(sorted(run.statuses.items())),
        "5xx": sum(n for status, n in run.statuses.items() if status >= 500),
        "transport_errors": dict(transport_errors),
        "first_errors": run.errors,
        "idle_at_end": {
            "requests_running": after.get("qinfer_requests_running"),
            "requests_waiting": after.get("qinfer_requests_waiting"),
            "kv_blocks_used": after.get("qinfer_kv_blocks_used"),
            "grammar_matchers_live": after.get("qinfer_grammar_matchers_live"),
        },
        "aborted": grew("qinfer_requests_aborted_total"),
        "finished": grew("qinfer_requests_finished_total"),
        "rss_mb": rss,
    }


def format_report(report: dict) -> str:
    idle, rss = report["idle_at_end"], report["rss_mb"]

    def mb(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    return "\n".join(
        [
            f"{report['requests']} requests in {report['seconds']:.0f} s "
            f"({report['requests_per_s']:.1f} req/s); statuses {report['statuses']}; "
            f"5xx {report['5xx']}; transport errors {report['transport_errors'] or 0}",
            f"kinds {json.dumps(report['kinds'])}",
            f"at the end, idle: running {idle['requests_running']:.0f}, waiting "
            f"{idle['requests_waiting']:.0f}, KV blocks used {idle['kv_blocks_used']:.0f}, "
            f"grammar matchers live {idle['grammar_matchers_live']:.0f}; "
            f"aborted {report['aborted']:.0f}, finished {report['finished']:.0f}",
            f"server RSS MB: start {mb(rss.get('start'))}, middle {mb(rss.get('middle'))}, "
            f"end {mb(rss.get('end'))}",
            *(f"error: {error}" for error in report["first_errors"]),
        ]
    )

"""Load test for `qinfer serve`: requests/s, time to first token, inter-token latency.

    python bench/load_server.py                        # starts `qinfer serve` (SmolLM2)
    python bench/load_server.py --concurrency 1 4 16 --requests 32 --max-tokens 64
    python bench/load_server.py --url http://127.0.0.1:8000 --api-key KEY
    python bench/load_server.py --soak 10000 --concurrency 8 --max-tokens 16

At each concurrency level, that many clients stream chat completions (`stream: true`,
raw server-sent events over httpx) until `--requests` have been sent; every request,
and the whole run, is bounded in time. Only loopback servers are accepted: this is a
bench for one machine, not a tool to load someone else's service.

Per level it reports requests/s, generated tokens/s, time to first token (request sent
-> first content event) and inter-token latency (gap between content events) as
p50/p90/p99. Each SSE event carries one engine output (usually one token), so the
inter-token latency is per event. The peer, measured in the same run once the server is
gone: the same chats, at the same concurrency, through an `AsyncEngine` in this process
(the engine the server wraps, without HTTP); server/direct tokens/s is the share of the
engine's throughput that survives the HTTP layer.

`--soak N` runs a different test instead of the levels: N requests of every API at once
(chat, Responses with previous_response_id chains, Anthropic Messages with tool blocks,
embeddings, dropped streams; bench/server_mix.py), at the largest `--concurrency`, then
the 5xx count, what is left held once the server is idle (KV blocks, grammar matchers)
and the server's RSS at start, middle and end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
from server_mix import format_report, soak

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works to a child.",
    "List some good habits for a programmer and say why.",
    "Describe the water cycle in a few sentences.",
]


@dataclass
class RequestTiming:
    """What one streamed request measured, in seconds from when it was sent."""

    first_token: float | None = None
    token_gaps: list[float] = field(default_factory=list)
    total: float = 0.0
    tokens: int = 0
    error: str | None = None


async def stream_one(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int
) -> RequestTiming:
    timing = RequestTiming()
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return timing
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if chunk.get("usage"):
                    timing.tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                delta = chunk["choices"][0]["delta"]
                if not (delta.get("content") or delta.get("reasoning_content")):
                    continue
                now = time.perf_counter()
                if timing.first_token is None:
                    timing.first_token = now - start
                else:
                    timing.token_gaps.append(now - last)
                last = now
    except httpx.HTTPError as error:
        timing.error = f"{type(error).__name__}: {error}"
    timing.total = time.perf_counter() - start
    return timing


async def run_level(
    url: str, api_key: str | None, concurrency: int, requests: int, max_tokens: int, timeout: float
) -> dict:
    """`requests` streamed chats, at most `concurrency` at once; the level's figures."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=timeout, limits=limits
    ) as client:
        gate = asyncio.Semaphore(concurrency)
        # the served model's name: a router in front (SMG) routes by it
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def limited(i: int) -> RequestTiming:
            async with gate:
                return await stream_one(client, model, PROMPTS[i % len(PROMPTS)], max_tokens)

        start = time.perf_counter()
        timings = await asyncio.gather(*(limited(i) for i in range(requests)))
        elapsed = time.perf_counter() - start
    done = [t for t in timings if t.error is None]
    first_tokens = [t.first_token for t in done if t.first_token is not None]
    gaps = [gap for t in done for gap in t.token_gaps]
    return {
        "concurrency": concurrency,
        "requests": requests,
        "errors": [t.error for t in timings if t.error is not None][:3],
        "failed": len(timings) - len(done),
        "seconds": elapsed,
        "requests_per_s": len(done) / elapsed,
        "tokens_per_s": sum(t.tokens for t in done) / elapsed,
        "mean_tokens": statistics.fmean([t.tokens for t in done]) if done else 0.0,
        "ttft_s": percentiles(first_tokens),
        "itl_s": percentiles(gaps),
        "latency_s": percentiles([t.total for t in done]),
    }


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 of `values` (nearest rank), or {} when there are none."""
    if not values:
        return {}
    ordered = sorted(values)

    def rank(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]

    return {"p50": rank(50), "p90": rank(90), "p99": rank(99)}


def format_table(levels: list[dict]) -> str:
    def ms(stats: dict, key: str) -> str:
        return f"{stats[key] * 1000:8.0f}" if stats else "       -"

    lines = [
        "conc  req/s   tok/s  tokens/req |  TTFT p50  p90      p99  (ms) |"
        "  ITL p50   p90      p99  (ms) | failed | direct tok/s  server/direct"
    ]
    for level in levels:
        ttft, itl = level["ttft_s"], level["itl_s"]
        lines.append(
            f"{level['concurrency']:4d} {level['requests_per_s']:6.2f} {level['tokens_per_s']:7.1f}"
            f" {level['mean_tokens']:10.1f} | {ms(ttft, 'p50')}{ms(ttft, 'p90')}{ms(ttft, 'p99')}      |"
            f" {ms(itl, 'p50')}{ms(itl, 'p90')}{ms(itl, 'p99')}      | {level['failed']:6d} |"
        )
        if "direct_tokens_per_s" in level:
            direct = level["direct_tokens_per_s"]
            lines[-1] += f" {direct:12.1f}  {level['tokens_per_s'] / direct:13.2f}"
    return "\n".join(lines)


def direct_figures(model: str | None, levels: list[dict], max_tokens: int) -> None:
    """The peer in the same run: the same chats through an `AsyncEngine` in this process
    (the engine the server wraps, set up alike), no HTTP; adds direct tok/s to each level."""
    from qinfer.core.checkpoint import resolve_model
    from qinfer.engine import AsyncEngine
    from qinfer.request.sampling import SamplingParams

    path = resolve_model(model)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)

    async def run(engine: AsyncEngine, level: dict) -> None:
        gate = asyncio.Semaphore(level["concurrency"])

        async def one(i: int) -> int:
            chat = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
            tokens = 0
            async with gate:
                async for output in engine.generate(chat, params):
                    tokens = output.num_generated_tokens
            return tokens

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(level["requests"])))
        level["direct_tokens_per_s"] = sum(tokens) / (time.perf_counter() - start)

    engine = AsyncEngine(path, max_num_seqs=max(level["concurrency"] for level in levels))
    try:
        asyncio.run(run(engine, {"concurrency": 1, "requests": 1}))  # warm-up, as for the server
        for level in levels:
            asyncio.run(run(engine, level))
    finally:
        engine.shutdown()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`qinfer serve` on a free loopback port; returns once /health answers."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "qinfer.cli",
        "serve",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
    ]
    command += ["--model", args.model] if args.model else []
    command += ["--max-num-seqs", str(max(args.concurrency))]
    # The server's log (one line per request) would bury the report: keep it in a file.
    log = tempfile.NamedTemporaryFile("w+", prefix="qinfer-serve-", suffix=".log", delete=False)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"qinfer serve exited with status {server.returncode}; see {log.name}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.terminate()
    raise SystemExit(f"qinfer serve did not answer within {args.startup_timeout} s; see {log.name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url", default=None, help="a running loopback server (default: start one)"
    )
    parser.add_argument(
        "--model", default=None, help="model for the started server (default: SmolLM2)"
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--requests", type=int, default=16, help="requests per level (max 256)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request (max 512)")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--soak",
        type=int,
        default=0,
        metavar="N",
        help="send N requests of the mixed APIs instead of the levels (bench/server_mix.py)",
    )
    parser.add_argument(
        "--no-direct",
        action="store_true",
        help="skip the peer run (the same chats through an in-process AsyncEngine, no HTTP)",
    )
    args = parser.parse_args()
    if not 1 <= args.requests <= 256 or not 1 <= args.max_tokens <= 512:
        parser.error("--requests must be in [1, 256] and --max-tokens in [1, 512]")
    if not all(1 <= c <= 64 for c in args.concurrency):
        parser.error("--concurrency levels must be in [1, 64]")
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        parser.error("--url must be a loopback address (127.0.0.1, localhost, ::1)")

    if not 0 <= args.soak <= 100_000:
        parser.error("--soak must be in [0, 100000]")

    server, url = (None, args.url) if args.url else start_server(args)
    if args.soak:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        pid = server.pid if server is not None else None
        run = soak(
            url,
            headers,
            args.soak,
            max(args.concurrency),
            args.max_tokens,
            args.request_timeout,
            pid,
        )
        try:
            report = asyncio.run(run)
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=30)
        print(json.dumps(report, indent=2) if args.json else format_report(report))
        return
    try:
        # One short request first, so the first level does not pay for warm-up.
        asyncio.run(run_level(url, args.api_key, 1, 1, 4, args.request_timeout))
        levels = []
        for c in args.concurrency:
            level = run_level(
                url, args.api_key, c, args.requests, args.max_tokens, args.request_timeout
            )
            levels.append(asyncio.run(level))
            # Progress on stderr: a long run still shows what it measured.
            print(format_table(levels[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    # After the server has gone, so that the two never share the CPUs.
    if not args.no_direct and (args.model or not args.url):
        direct_figures(args.model, levels, args.max_tokens)
    print(json.dumps(levels, indent=2) if args.json else format_table(levels))


if __name__ == "__main__":
    main()

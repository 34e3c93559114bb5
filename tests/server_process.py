"""`qinfer serve` as a real subprocess, and what a test reads off a running server."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    """A loopback port nobody listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve_command(
    *args: str, timeout: float = 60, port: int | None = None
) -> tuple[subprocess.Popen, str]:
    """Start `qinfer serve ARGS --port P` (P: `port`, or a free one) and wait until its
    /health answers 200; return the process (stderr piped) and its URL. A server that exits
    or stays silent fails the test with what it printed."""
    port = port or free_port()
    command = [sys.executable, "-m", "qinfer.cli", "serve", *args, "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        assert server.poll() is None, server.stderr.read().decode()
        assert time.monotonic() < deadline, "qinfer serve did not start"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.2)


@contextmanager
def serving(*args: str, timeout: float = 120) -> Iterator[str]:
    """`qinfer serve ARGS` running for the block's duration; yields its URL."""
    process, url = start_serve_command(*args, timeout=timeout)
    try:
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def metric_values(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


def wait_until_idle(http: httpx.Client, timeout: float = 30) -> dict[str, float]:
    """Metrics once the engine runs nothing and holds no KV blocks."""
    deadline = time.monotonic() + timeout
    while True:
        values = metric_values(http)
        idle = values["qinfer_requests_running"] == 0 and values["qinfer_requests_waiting"] == 0
        if (idle and values["qinfer_kv_blocks_used"] == 0) or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


def chat_usage(client, model: str, messages: list[dict], thinking: bool = False, **fields):
    """The usage of a conversation answered greedily by chat completions (the `openai`
    client's, to a server serving `model`), to hold another API's token counts to."""
    reply = client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
        **fields,
    )
    return reply.usage


def assert_aborted_streams_free_their_requests(
    http: httpx.Client, path: str, body: dict, opening: str
) -> None:
    """Open 8 streams of `body` (which never ends by itself) on `path` and leave each after
    its first line (`opening`): every one is counted as aborted and frees its KV blocks."""
    aborted = metric_values(http)["qinfer_requests_aborted_total"]
    for _ in range(8):
        with http.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            assert next(response.iter_lines()) == opening
    values = wait_until_idle(http)
    assert values["qinfer_requests_running"] == 0 and values["qinfer_kv_blocks_used"] == 0
    assert values["qinfer_requests_aborted_total"] == aborted + 8

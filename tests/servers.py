"""One way to stand a server up in a test, and what a test reads off a running one.

    with serving("--model", path, ...) as server:    # `qinfer serve ARGS` as a process
    with serving(app=create_app(...)) as server:     # an app in this process (uvicorn)
    server.url, server.process                     # the process: None in process

Either way the server answers before the block starts and is stopped when it ends (a
process the test already stopped is only reaped). The `serve` fixture (conftest) does the
same for one test: `server = serve(...)`.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Served:
    """A running server: its URL, and the `qinfer serve` process behind it (stderr piped),
    None for an app served in this process."""

    url: str
    process: subprocess.Popen | None = None


@contextmanager
def serving(
    *args: str, app=None, timeout: float = 120, port: int | None = None
) -> Iterator[Served]:
    """`qinfer serve ARGS --port P` (P: `port`, or a free one) until its /health answers
    200, or, given `app`, that FastAPI app on a uvicorn thread of this process; stopped on
    leaving the block. A process that exits or stays silent fails the test with what it
    printed."""
    if app is not None:
        with _in_process(app) as url:
            yield Served(url)
        return
    # a free port picked here can be taken (an outgoing connection's) before the server
    # binds it: then the server exits saying so, and another port is tried
    for attempt in range(3):
        chosen = port or free_port()
        command = [sys.executable, "-m", "qinfer.cli", "serve", *args, "--port", str(chosen)]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            url = f"http://127.0.0.1:{chosen}"
            try:
                _wait_for_health(process, url, timeout)
            except PortTaken:
                if port is not None or attempt == 2:
                    raise
                continue
            yield Served(url, process)
            return
        finally:
            if process.poll() is None:
                process.terminate()
            process.wait(timeout=30)


class PortTaken(AssertionError):
    """The server exited because its port was in use."""


def free_port() -> int:
    """A loopback port nobody listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_health(process: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            printed = process.stderr.read().decode()
            raise (PortTaken if "Address already in use" in printed else AssertionError)(printed)
        assert time.monotonic() < deadline, "qinfer serve did not start"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


@contextmanager
def _in_process(app) -> Iterator[str]:
    """`app` on a free loopback port, served by uvicorn in a background thread; its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while not server.started:
                assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
                time.sleep(0.02)
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True
            thread.join(timeout=30)


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

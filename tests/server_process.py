"""`qinfer serve` as a real subprocess, for the tests of the command line."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx


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

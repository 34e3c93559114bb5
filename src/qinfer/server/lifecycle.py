"""How `qinfer serve` starts and stops around uvicorn.

Start: the address is tried before the model loads (`check_address`: a port in use or a
host that does not resolve is one `qinfer: error:` line, not a traceback after a long
load); once uvicorn listens, one line gives the chat page's, the inspector's and the API's
URLs. uvicorn's own start and stop messages are left out (the lines here say it all);
its access log stays.

Stop (Ctrl-C or SIGTERM): every queued and running request is aborted at once, so each
open stream ends with its final event (finish_reason "abort", then `data: [DONE]`) and
its connection closes; uvicorn's graceful shutdown then has nothing left to wait for.
One line says so, and the command exits with status 0. A second Ctrl-C changes nothing
(the stop is bounded already).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
from collections.abc import Iterator
from types import FrameType

import uvicorn
from fastapi import FastAPI

from qinfer.core.errors import QinferError
from qinfer.engine import AsyncEngine

#: Seconds uvicorn waits for connections after a stop before it cancels them. The aborted
#: streams end within a step; this bounds a client that never reads its last bytes.
GRACEFUL_SHUTDOWN_SECONDS = 2


def check_address(host: str, port: int) -> None:
    """Bind (host, port) once and let go: refuse, naming the flag, an address the server
    could not listen on."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise QinferError(f"--host {host}: {error.strerror}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            probe.bind(address)
        except OSError as error:
            raise QinferError(
                f"--port {port}: cannot listen on {host}:{port}: {error.strerror}"
            ) from None


def page_urls(host: str, port: int) -> str:
    """`qinfer: serving at URL: chat page URL/, inspector URL/inspect, API URL/v1`."""
    shown = "localhost" if host in ("0.0.0.0", "::", "") else host  # where a browser here goes
    base = f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"
    return (
        f"qinfer: serving: chat page {base}/  inspector {base}/inspect  "
        f"API {base}/v1 (Ctrl-C stops)"
    )


class Server(uvicorn.Server):
    """uvicorn's server, which says where it serves and aborts the engine's requests on
    the first Ctrl-C (see the module docstring)."""

    def __init__(self, app: FastAPI, engine: AsyncEngine, host: str, port: int, log_level: str):
        super().__init__(
            uvicorn.Config(
                app,
                host=host,
                port=port,
                log_level=log_level,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
            )
        )
        logger = logging.getLogger("uvicorn.error")  # start/stop chatter; errors stay
        logger.setLevel(max(logger.level, logging.WARNING))
        self.engine, self.urls = engine, page_urls(host, port)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, without raising the stopping signal again once stopped: the line
        `handle_exit` printed says it all, and the command ends normally (status 0)."""
        with super().capture_signals():
            yield
            self._captured_signals.clear()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.urls, file=sys.stderr, flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The first Ctrl-C (or SIGTERM) aborts every request and starts the stop; later
        ones change nothing: the stop is bounded already (GRACEFUL_SHUTDOWN_SECONDS), and
        uvicorn's "force quit" would leave the app's shutdown undone (a traceback)."""
        if self.should_exit:
            return
        super().handle_exit(sig, frame)
        aborted = self.engine.stop_serving()
        requests = f"{aborted} request{'s' * (aborted != 1)}"
        after_caret = "\n" if sys.stderr.isatty() else ""  # the terminal echoed ^C
        print(f"{after_caret}qinfer: stopping; {requests} aborted", file=sys.stderr, flush=True)

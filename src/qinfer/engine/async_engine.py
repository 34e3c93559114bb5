"""The engine for a server: requests from asyncio, model steps in a background thread.

    engine = AsyncEngine("path/to/checkpoint", max_num_seqs=32)
    async for output in engine.generate("Hello", SamplingParams(max_tokens=16)):
        print(output.delta_text, end="")

One thread owns the `Engine` and runs `step()` while there is work. The event loop never
waits for a model step: requests are checked and encoded in the caller's thread, then
handed to the step thread through a queue (so are aborts); outputs come back to each
request's asyncio queue with `call_soon_threadsafe`. `stats()` returns the snapshot the
step thread publishes after every step. `run_with_model(fn)` runs other work on the model
(an inspection) in that thread too, between two steps, so it never races a step; so does
`flush_prefix_cache()`.

Under tensor parallelism a worker that dies (during a step, or while the engine is idle:
the group's watch) fails the engine for good: running requests fail, new ones are
refused, `failure` holds the one-line error and `on_failure`, if set, is called with it
(the server then stops).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from qinfer.core.errors import EngineOverloadedError, QinferError, RequestError
from qinfer.core.model_config import ModelConfig
from qinfer.engine.block_manager import CacheFlush
from qinfer.engine.build import LoadConfig, build_engine
from qinfer.engine.engine import Engine
from qinfer.engine.outputs import RequestOutput
from qinfer.engine.request import Request
from qinfer.engine.stats import EngineStats
from qinfer.model.transformer import Transformer
from qinfer.request.pooling import PoolingParams
from qinfer.request.sampling import SamplingParams
from qinfer.request.scoring import ScoreParams
from qinfer.runtime.distributed import TensorParallelError
from qinfer.text.prompts import Prompt
from qinfer.text.tokenizer import Tokenizer

T = TypeVar("T")


@dataclass
class _Stream:
    """Where one request's outputs go: an asyncio queue on the loop that asked for them."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue


class AsyncEngine:
    """A batching engine that serves many concurrent asyncio callers (see the module doc).

    Arguments as for `qinfer.LLM`; `max_waiting_requests` (an engine argument) bounds the
    requests that may wait for a slot: beyond it `add_request` raises EngineOverloadedError.
    on_failure: None, or a function called once (from another thread) with the error
    that ended a tensor-parallel group; set it, then check `failure`, to miss none.
    """

    def __init__(
        self,
        model_or_path: Transformer | str | Path,
        tokenizer: Tokenizer | str | Path | None = None,
        *,
        load: LoadConfig | None = None,
        **keywords,
    ) -> None:
        load, engine_args = LoadConfig.split(keywords, load)
        self.engine = build_engine(model_or_path, tokenizer, load, engine_args)
        self.tokenizer = self.engine.tokenizer
        # ("add", Request) | ("abort", id) | ("call", _EngineCall) | ("stop", None)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()  # guards _streams between loop and step thread
        self._stats = self.engine.stats()
        self._stopping = False
        self.failure: TensorParallelError | None = None
        self.on_failure: Callable[[TensorParallelError], None] | None = None
        if self.engine.executor.group is not None:
            self.engine.executor.group.watch(self._fail_group)
        self._thread = threading.Thread(target=self._run, name="qinfer-engine", daemon=True)
        self._thread.start()

    # -- called from the event loop --------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora: str | None = None,
    ) -> str:
        """Check, encode and queue a request (call it from a running event loop); its id.
        lora: the loaded LoRA adapter it runs through (None: the base model).

        Raises RequestError (bad request) or EngineOverloadedError (too many waiting).
        """
        self._check_serving()
        return self._enqueue(self.engine.make_request(prompt, params, request_id, lora))

    def _check_serving(self) -> None:
        """Refuse new work once the engine has failed or is shutting down."""
        if self.failure is not None:
            raise self.failure
        if self._stopping:
            raise QinferError("the engine is shut down")

    def _enqueue(self, request: Request) -> str:
        """Hand a request made by `make_request` to the step thread; its id."""
        request_id = request.seq.request_id
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise QinferError(
                "AsyncEngine.add_request must be called from a running asyncio event loop"
            ) from None
        stream = _Stream(loop, asyncio.Queue())
        with self._streams_lock:
            if request_id in self._streams:
                raise RequestError(f"request_id {request_id!r} is already in use")
            waiting = len(self._streams) - self._stats.num_running
            if waiting >= self.engine.config.max_waiting_requests:
                raise EngineOverloadedError(
                    f"the engine is overloaded: {waiting} requests are waiting "
                    f"(max_waiting_requests={self.engine.config.max_waiting_requests})"
                )
            self._streams[request_id] = stream
        self._inbox.put(("add", request))
        return request_id

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | PoolingParams | ScoreParams | None = None,
        request_id: str | None = None,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs as tokens arrive; the last has finished=True.
        With PoolingParams (ScoreParams), one output: finished, with its `embedding`
        (`score`). lora: the loaded LoRA adapter it runs through. Leaving the loop
        early (or cancelling the task) aborts the request."""
        self._check_serving()
        # Encoding the prompt and compiling a grammar (about a second for a large schema
        # over a 150k vocabulary) run in a worker thread: other streams keep flowing.
        request = await asyncio.to_thread(
            self.engine.make_request, prompt, params, request_id, lora
        )
        request_id = self._enqueue(request)
        stream = self._streams[request_id]
        finished = False
        try:
            while not finished:
                output = await stream.outputs.get()
                if isinstance(output, BaseException):
                    raise output
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    async def run_with_model(self, fn: Callable[[Transformer], T]) -> T:
        """fn(model) run in the step thread between two steps; its result (or exception).

        The event loop waits without blocking; the engine's requests pause for the call's
        length. fn must not keep the model's state changed (it gets the engine's model).
        """
        return await self._run_in_step_thread(lambda engine: fn(engine.executor.model))

    async def load_lora(self, name: str, path: str) -> None:
        """`Engine.load_lora`, between two steps."""
        await self._run_in_step_thread(lambda engine: engine.load_lora(name, path))

    async def unload_lora(self, name: str) -> None:
        """`Engine.unload_lora`, between two steps."""
        await self._run_in_step_thread(lambda engine: engine.unload_lora(name))

    async def flush_prefix_cache(self) -> CacheFlush:
        """Forget the cached prefixes no request holds (between two steps); what was
        dropped and what running requests keep."""
        return await self._run_in_step_thread(
            lambda engine: engine.block_manager.flush_prefix_cache()
        )

    async def _run_in_step_thread(self, fn: Callable[[Engine], T]) -> T:
        self._check_serving()
        loop = asyncio.get_running_loop()
        call = _EngineCall(fn, loop, loop.create_future())
        self._inbox.put(("call", call))
        return await call.result

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort". Unknown ids are ignored."""
        self._inbox.put(("abort", request_id))

    def stop_serving(self) -> int:
        """Refuse new requests and abort every one queued or running (their streams end
        with finish_reason "abort"); how many were aborted. Safe to call from any thread
        (a server's Ctrl-C handler); `shutdown` still stops the step thread."""
        self._stopping = True
        with self._streams_lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self.abort(request_id)
        return len(request_ids)

    def stats(self) -> EngineStats:
        """The engine's counters as of its last step."""
        return self._stats

    @property
    def model_config(self) -> ModelConfig:
        """The served model's configuration (read-only)."""
        return self.engine.model.config

    @property
    def context_len(self) -> int:
        """The longest sequence (prompt and completion) a request may reach, in tokens."""
        return self.engine.context_len

    def shutdown(self) -> None:
        """Stop the step thread (pending requests are aborted)."""
        self._stopping = True
        self._inbox.put(("stop", None))
        self._thread.join()
        self.engine.close()

    # -- the step thread ---------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            # Block for work only when idle; otherwise take what arrived and step.
            while True:
                try:
                    command, arg = self._inbox.get(block=not engine.has_unfinished())
                except queue.Empty:
                    break
                if command == "stop":
                    self._stop()
                    return
                self._apply(command, arg)
            try:
                outputs = engine.step()
            except TensorParallelError as error:  # the group is gone: so is the engine
                self._fail_group(error)
                self._stop(error)
                return
            except Exception as error:  # a failing step fails its requests, not the server
                outputs = []
                for request_id in list(engine.requests):
                    engine.abort(request_id)
                    self._fail(request_id, error)
            for output in outputs:
                self._deliver(output)
            self._stats = engine.stats()

    def _fail_group(self, error: TensorParallelError) -> None:
        if self.failure is None:
            self.failure = error
            if self.on_failure is not None:
                self.on_failure(error)

    def _stop(self, error: QinferError | None = None) -> None:
        """Abort what runs or waits (or, given the error that ended the engine, fail it with
        that error), and refuse what is still in the inbox."""
        for request_id in list(self.engine.requests):
            output = self.engine.abort(request_id)
            if error is None:
                self._deliver(output)
            else:
                self._fail(request_id, error)
        while True:
            try:
                command, arg = self._inbox.get(block=False)
            except queue.Empty:
                break
            refusal = error or QinferError("the engine is shut down")
            if command == "add":
                self._fail(arg.seq.request_id, refusal)
            elif command == "call":
                arg.settle(None, refusal)

    def _apply(self, command: str, arg) -> None:
        if command == "add":
            request: Request = arg
            try:
                self.engine.add(request)
            except QinferError as error:
                self._fail(request.seq.request_id, error)
        elif command == "abort":
            self._deliver(self.engine.abort(arg))
        elif command == "call":
            call: _EngineCall = arg
            try:
                call.settle(call.fn(self.engine), None)
            except Exception as error:  # the caller's to report; the engine goes on
                call.settle(None, error)
        self._stats = self.engine.stats()

    def _deliver(self, output: RequestOutput | None) -> None:
        if output is None:
            return
        with self._streams_lock:
            stream = self._streams.get(output.request_id)
            if output.finished:
                self._streams.pop(output.request_id, None)
        if stream is not None:
            _post(stream, output)

    def _fail(self, request_id: str, error: BaseException) -> None:
        with self._streams_lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            _post(stream, error)


@dataclass
class _EngineCall:
    """A function to run on the engine in the step thread, and where its result goes."""

    fn: Callable[[Engine], Any]
    loop: asyncio.AbstractEventLoop
    result: asyncio.Future

    def settle(self, value: Any, error: BaseException | None) -> None:
        """Hand the result (or the error) to the caller's loop; a caller gone is ignored."""

        def deliver() -> None:
            if self.result.done():  # the caller was cancelled (its client left)
                return
            if error is None:
                self.result.set_result(value)
            else:
                self.result.set_exception(error)

        try:
            self.loop.call_soon_threadsafe(deliver)
        except RuntimeError:
            pass  # the caller's event loop is gone


def _post(stream: _Stream, item: RequestOutput | BaseException) -> None:
    """Hand an item to a stream's event loop (dropped if that loop has closed)."""
    try:
        stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)
    except RuntimeError:
        pass  # the caller's event loop is gone: nobody is listening

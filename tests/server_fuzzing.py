"""What tests/test_server_fuzz_*.py share (issue 30: no 5xx anywhere): the apps in this
process, the property every answer is held to, and the strategies every body is made of.

The property: the answer is 2xx or 4xx, never 5xx; a 4xx is the API's JSON error (OpenAI's,
Anthropic's for /v1/messages) naming the field at fault; a stream is well-formed server-sent
events that end as the API's clients expect; nothing is logged as an internal error. The apps
run in this process (httpx's ASGI transport on one event loop, no sockets). Bodies are valid
ones (a tiny token budget, so generation is cheap), then mutations of them (a field dropped,
a value of the wrong type, out of range or huge, unknown fields, garbage nested anywhere) and
bodies that are no JSON object at all; examples are derandomized, so CI runs the same bodies
every time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from test_server_anthropic import FORECAST

import qinfer
from qinfer.engine import AsyncEngine
from qinfer.request.sampling import SamplingParams
from qinfer.server.app import ServerSettings, create_app

MODEL = "fuzz"
#: Bodies sent together in one example, as concurrent clients (the engine batches them).
BATCH = 8
#: Examples per endpoint: EXAMPLES x BATCH = 400 bodies each, what CI's time allows (these
#: modules take about 70 s on 2 cores); issue 30's 2,000 (QINFER_FUZZ_EXAMPLES=250) take about
#: 6 minutes.
EXAMPLES = int(os.environ.get("QINFER_FUZZ_EXAMPLES", "50"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same bodies on every run: CI is reproducible
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
#: The context bounds what a huge valid max_tokens costs (a random prompt never stops):
#: room for a forced call after the tool prompt (about 580 tokens), little more.
ENGINE_ARGS = dict(max_num_seqs=32, max_num_batched_tokens=1024, max_model_len=768)


# --- the apps, in this process -----------------------------------------------------------


class InProcess:
    """An app answering through httpx's ASGI transport on an event loop of its own thread
    (as uvicorn's would be); records what the server logs as an internal error.

    The loop runs one task for its whole life, so that anyio keeps the worker threads of
    the app's sync dependencies (it ends them with the loop's outermost task): a loop run
    per request would start new threads every time, and cost more than the request.
    """

    def __init__(self, app) -> None:
        self.loop = asyncio.new_event_loop()
        self._stopped = asyncio.Event()
        self._thread = threading.Thread(
            target=self.loop.run_until_complete, args=(self._stopped.wait(),), daemon=True
        )
        self._thread.start()
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        self.http = httpx.AsyncClient(transport=transport, base_url="http://fuzz", timeout=60)
        self.errors: list[logging.LogRecord] = []
        self._handler = _Recorder(self.errors)
        logging.getLogger("qinfer.server").addHandler(self._handler)

    def post_all(self, path: str, contents: list[bytes]) -> list[httpx.Response]:
        """The answers to `contents` POSTed to `path` at once (as concurrent clients)."""
        headers = {"content-type": "application/json"}

        async def post_all() -> list[httpx.Response]:
            posts = [self.http.post(path, content=c, headers=headers) for c in contents]
            return await asyncio.gather(*posts)

        return self.run(post_all())

    def post_json(self, path: str, body: Any) -> httpx.Response:
        return self.post_all(path, [json.dumps(body).encode()])[0]

    def run(self, coroutine) -> Any:
        """Run `coroutine` on the app's loop; its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        logging.getLogger("qinfer.server").removeHandler(self._handler)
        self.run(self.http.aclose())
        self.loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join()
        self.loop.close()


class _Recorder(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(logging.ERROR)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def serve(folder, **engine_args) -> Iterator[InProcess]:
    tokenizer = qinfer.load_tokenizer(folder)
    engine = AsyncEngine(folder, tokenizer, dtype="float32", **{**ENGINE_ARGS, **engine_args})
    settings_ = ServerSettings(
        model_name=MODEL, default_params=SamplingParams.from_generation_config(folder)
    )
    served = InProcess(create_app(engine, tokenizer, settings_))
    yield served
    served.close()
    engine.shutdown()


# --- what every answer must be ----------------------------------------------------------


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each server-sent event; fails on a malformed stream."""
    assert text.endswith("\n\n"), f"the stream does not end with a whole event: {text[-200:]!r}"
    events = []
    for block in text[:-2].split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            assert field in ("event", "data"), f"not an SSE line: {line!r}"
            if field == "event":
                name = value
            else:
                data.append(value)
        assert data, f"an event without data: {block!r}"
        events.append((name, "\n".join(data)))
    return events


def check_openai_stream(text: str) -> None:
    """Chunks, each a JSON object, none an error, then `data: [DONE]`."""
    events = sse_events(text)
    assert events[-1] == (None, "[DONE]"), events[-1]
    for _, data in events[:-1]:
        chunk = json.loads(data)
        assert "error" not in chunk, chunk


def check_responses_stream(text: str) -> None:
    """Named events with increasing sequence numbers; the last is the response's end."""
    events = sse_events(text)
    payloads = [json.loads(data) for _, data in events]
    assert [name for name, _ in events] == [p["type"] for p in payloads]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert payloads[0]["type"] == "response.created"
    last = payloads[-1]
    assert last["type"] in ("response.completed", "response.incomplete"), last
    assert last["type"] == f"response.{last['response']['status']}"


def check_anthropic_stream(text: str) -> None:
    """message_start ... message_delta (a stop reason), message_stop; no error event."""
    events = sse_events(text)
    payloads = [json.loads(data) for _, data in events]
    assert [name for name, _ in events] == [p["type"] for p in payloads]
    assert payloads[0]["type"] == "message_start", payloads[0]
    assert [p["type"] for p in payloads[-2:]] == ["message_delta", "message_stop"], payloads[-2:]
    assert payloads[-2]["delta"]["stop_reason"] is not None


STREAM_CHECKS: dict[str, Callable[[str], None]] = {
    "/v1/chat/completions": check_openai_stream,
    "/v1/completions": check_openai_stream,
    "/v1/responses": check_responses_stream,
    "/v1/messages": check_anthropic_stream,
}

#: The finish reasons (chat and text completions), statuses (Responses) and stop
#: reasons (Messages) of a finished reply.
FINISH_REASONS = {"stop", "length", "tool_calls"}
STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use"}


def check_answer(body: dict[str, Any], path: str) -> None:
    """A JSON answer of a finished request, as its API says it ends."""
    if path in ("/v1/chat/completions", "/v1/completions"):
        assert {c["finish_reason"] for c in body["choices"]} <= FINISH_REASONS, body
    elif path == "/v1/responses":
        assert body["status"] in ("completed", "incomplete"), body
    elif path == "/v1/messages":
        assert body["stop_reason"] in STOP_REASONS, body


def request_fields(request: bytes) -> set[str]:
    """The top-level fields of a request body (none when it is no JSON object)."""
    try:
        parsed = json.loads(request)
    except ValueError:
        return set()
    return set(parsed) if isinstance(parsed, dict) else set()


#: How a 400 may name no request field: a body that is no JSON object, a conversation
#: longer than the context (named as the prompt it makes), and an output constraint
#: llguidance cannot compile, named by its kind as the engine reads it (the request's
#: format type or guided_* field says which: `json_schema`, `regex`, ...).
BODY_ERRORS = (
    "Request body is not valid JSON",
    "Request body must be a JSON object",
    "prompt has ",
)
CONSTRAINT_ERRORS = tuple(f"{kind} is invalid: " for kind in ("json_schema", "regex", "grammar"))


def names_a_field(message: str, fields: set[str], required: tuple[str, ...]) -> bool:
    """Whether an error message quotes one of the request's fields (those it sent or one
    it must send), or is one of the errors that need not (BODY_ERRORS, CONSTRAINT_ERRORS)."""
    if message.startswith(BODY_ERRORS + CONSTRAINT_ERRORS):
        return True
    return any(name in message for name in fields | set(required))


def check_error(response: httpx.Response, path: str, request: bytes, required: tuple) -> None:
    """A 4xx: the API's JSON error, one line, naming the field at fault."""
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error", body
        assert {"type", "message"} <= set(body["error"]) <= {"type", "message", "details"}
        message, param = body["error"]["message"], None
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        message, param = body["error"]["message"], body["error"]["param"]
    assert message and "Traceback" not in message, message
    if response.status_code == 400:
        fields = request_fields(request)
        named = param is not None and param.split(".")[0] in fields | set(required)
        assert named or names_a_field(message, fields, required), (message, param, request)


def check(app: InProcess, path: str, requests: list[bytes], required: tuple[str, ...]) -> None:
    """POST `requests` to `path` together and hold each answer to the property (module
    docstring); required: the fields a body of this route must have."""
    responses = app.post_all(path, requests)
    assert not app.errors, app.errors[0].getMessage()
    for request, response in zip(requests, responses, strict=True):
        check_one(path, request, response, required)


def check_one(
    path: str, request: bytes, response: httpx.Response, required: tuple[str, ...]
) -> None:
    assert response.status_code < 500, (response.status_code, response.text, request)
    assert 200 <= response.status_code < 300 or 400 <= response.status_code < 500
    if response.status_code >= 400:
        check_error(response, path, request, required)
    elif response.headers["content-type"].startswith("text/event-stream"):
        STREAM_CHECKS[path](response.text)
    elif path in STREAM_CHECKS:
        check_answer(response.json(), path)


# --- bodies ------------------------------------------------------------------------------

#: Short texts (prompts stay a few tokens), with what templates and parsers could trip on.
texts = st.sampled_from(
    ["Hello world", "", " ", "\n", "<|im_end|>", "<think>", "</think>", "<tool_call>", "{", "é✓🙂"]
) | st.text(max_size=4)
#: Numbers at and past every bound: signs, 32 and 64 bits, floats that are not numbers.
edge_numbers = st.sampled_from(
    [0, 1, -1, 2, 3, 5, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30]
) | st.floats(allow_nan=True, allow_infinity=True)
scalars = st.none() | st.booleans() | edge_numbers | texts
#: Any JSON value, small.
garbage = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=4,
)
#: Names of fields no API has, and names close to real ones.
unknown_fields = st.sampled_from(["x", "", "temprature", "messages ", "__proto__"]) | st.text(
    max_size=4
)

#: Schemas a reply or a tool's arguments may follow: good, odd and invalid ones.
schemas = st.sampled_from(
    [
        FORECAST,
        {"type": "object"},
        {"type": "string", "maxLength": 3},
        {"enum": ["a", "b"]},
        {},
        {"type": "nope"},
        {"type": "object", "properties": [1]},
        {"type": "object", "dependentSchemas": {"a": {}}},
        {"$ref": "#/nowhere"},
    ]
)
ARGUMENTS = '{"city": "Paris", "days": 2}'
small_ints = st.integers(0, 4)
budgets = st.integers(1, 4)


def optional(**fields: st.SearchStrategy) -> st.SearchStrategy[dict[str, Any]]:
    """A few of `fields` (up to four), each drawn from its strategy."""
    names = st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)
    return names.flatmap(lambda chosen: st.fixed_dictionaries({n: fields[n] for n in chosen}))


def paths(node: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """The path of every value inside a JSON value (the value itself first)."""
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from paths(value, (*prefix, i))


def replaced(node: Any, path: tuple, value: Any) -> Any:
    """`node` with the value at `path` replaced (None: removed)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(node, dict):
        copy = dict(node)
        if not rest and value is _REMOVED:
            del copy[head]
        else:
            copy[head] = replaced(node[head], rest, value)
        return copy
    copy = list(node)
    if not rest and value is _REMOVED:
        del copy[head]
    else:
        copy[head] = replaced(node[head], rest, value)
    return copy


_REMOVED = object()


@st.composite
def mutated(draw, body: dict[str, Any]) -> dict[str, Any]:
    """`body` changed once: a value anywhere removed or replaced by garbage or an edge
    number, or a field (known or not) set to one."""
    kind = draw(st.sampled_from(["remove", "replace", "set", "unknown"]))
    inner = [path for path in paths(body) if path]
    if kind in ("remove", "replace") and inner:
        path = draw(st.sampled_from(inner))
        return replaced(body, path, _REMOVED if kind == "remove" else draw(garbage))
    name = draw(st.sampled_from(sorted(body)) if kind == "set" and body else unknown_fields)
    return {**body, name: draw(garbage | edge_numbers)}


def not_an_object(valid: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """Bodies that are no JSON object: other JSON values, cut JSON, bytes, deep nesting."""
    whole = json.dumps(valid).encode()
    return st.one_of(
        garbage.filter(lambda value: not isinstance(value, dict)).map(
            lambda value: json.dumps(value).encode()
        ),
        st.integers(0, len(whole) - 1).map(lambda cut: whole[:cut]),
        st.binary(max_size=16),
        st.integers(1, 400).map(lambda depth: b'{"a": ' + b"[" * depth + b"]" * depth + b"}"),
        st.just(b'{"model": "\\ud800"}'),
    )


def batches(valid: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[list[bytes]]:
    """BATCH `requests` of `valid` bodies."""
    return st.lists(requests(valid), min_size=BATCH, max_size=BATCH)


@st.composite
def requests(draw, valid: st.SearchStrategy[dict[str, Any]]) -> bytes:
    """A request: a valid body (one in five), a mutation of one (up to three changes,
    three in four), or no JSON object at all (one in twenty)."""
    body = draw(valid)
    roll = draw(st.integers(0, 19))
    if roll == 0:
        return draw(not_an_object(body))
    if roll >= 5:
        for _ in range(draw(st.integers(1, 3))):
            body = draw(mutated(body))
    return json.dumps(body).encode()

"""Every endpoint's JSON body, fuzzed (issue 30: no 5xx anywhere).

Hypothesis writes bodies for each route: valid ones (a tiny token budget, so generation is
cheap: tools, forced calls, JSON formats, reasoning, streams), then mutations of them (a
field dropped, a value of the wrong type, out of range or huge, unknown fields, garbage
nested anywhere) and bodies that are no JSON object at all. The property, for every one:
the answer is 2xx or 4xx, never 5xx; a 4xx is the API's JSON error (OpenAI's, Anthropic's
for /v1/messages) naming the field at fault; a stream is well-formed server-sent events
that end as the API's clients expect; nothing is logged as an internal error.

The apps run in this process (httpx's ASGI transport on one event loop, no sockets) over
the planted Qwen3 (tests/planted_qwen3.py: a thinking model with Qwen3's tool format) and,
for embeddings, rerank and score, a random Qwen3 whose vocabulary has "yes" and "no".
Examples are derandomized, so CI runs the same bodies every time.

The cut-point tests end a forced tool call, a JSON-schema reply and a reasoning block at
every token budget: always a 200, with the finish reason or status of a cut reply.
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
import pytest
from checkpoints import build_checkpoint, build_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planted_qwen3 import build_planted_qwen3
from test_server_anthropic import FORECAST

import qinfer
from qinfer.engine import AsyncEngine
from qinfer.request.sampling import SamplingParams
from qinfer.server.app import ServerSettings, create_app

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = pytest.mark.slow

MODEL = "fuzz"
#: Bodies sent together in one example, as concurrent clients (the engine batches them).
BATCH = 8
#: Examples per endpoint: EXAMPLES x BATCH = 400 bodies each, what CI's time allows (this
#: file takes about 70 s on 2 cores); issue 30's 2,000 (QINFER_FUZZ_EXAMPLES=250) take about
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


@pytest.fixture(scope="module")
def chat_app(tmp_path_factory) -> Iterator[InProcess]:
    """The planted Qwen3 (a thinking model, Qwen3's tool calls)."""
    folder = build_planted_qwen3(tmp_path_factory.mktemp("fuzz-chat"), max_position_embeddings=1024)
    yield from serve(folder)


@pytest.fixture(scope="module")
def scoring_app(tmp_path_factory) -> Iterator[InProcess]:
    """A random Qwen3 whose vocabulary has "yes" and "no": it embeds and scores."""
    folder = tmp_path_factory.mktemp("fuzz-scores")
    build_checkpoint(folder, "qwen3", vocab_size=264)
    build_tokenizer(folder, words=("yes", "no"))
    yield from serve(folder)


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


# -- chat completions and completions

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather", "parameters": FORECAST},
}
chat_messages = st.lists(
    st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": texts}),
        st.fixed_dictionaries(
            {"role": st.just("user"), "content": st.lists(st.just({"type": "text", "text": "hi"}))}
        ),
        st.just(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ARGUMENTS},
                    }
                ],
            }
        ),
        st.fixed_dictionaries(
            {"role": st.just("assistant"), "content": texts}, optional={"reasoning_content": texts}
        ),
        st.fixed_dictionaries(
            {"role": st.just("tool"), "tool_call_id": st.just("call_1"), "content": texts}
        ),
    ),
    min_size=1,
    max_size=3,
)
tool_choices = st.sampled_from(
    ["none", "auto", "required", {"type": "function", "function": {"name": "get_weather"}}]
)
response_formats = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    st.builds(
        lambda schema, strict: {
            "type": "json_schema",
            "json_schema": {"name": "reply", "schema": schema, "strict": strict},
        },
        schemas,
        st.sampled_from([True, False, None]),
    ),
)
sampling = dict(
    temperature=st.sampled_from([0, 0.5, 1.0, 2.0]),
    top_p=st.sampled_from([0.5, 1.0]),
    top_k=st.sampled_from([0, 1, 5, 1000]),
    min_p=st.sampled_from([0, 0.1]),
    presence_penalty=st.sampled_from([-2, 0, 1.5]),
    frequency_penalty=st.sampled_from([-2, 0, 1.5]),
    repetition_penalty=st.sampled_from([0.5, 1.0, 1.3]),
    seed=st.integers(0, 2**62),
    stop=st.sampled_from(["\n", ["a", "Hello"], []]),
    logit_bias=st.sampled_from([{"5": 10}, {"0": -100}, {}]),
    user=texts,
    metadata=st.just({"k": "v"}),
)
chat_bodies = st.builds(
    lambda messages, budget, fields: {"model": MODEL, "messages": messages, **budget, **fields},
    chat_messages,
    st.sampled_from(["max_tokens", "max_completion_tokens"]).flatmap(
        lambda name: st.fixed_dictionaries({name: budgets})
    ),
    optional(
        **sampling,
        n=st.integers(1, 2),
        stream=st.booleans(),
        stream_options=st.just({"include_usage": True}),
        logprobs=st.booleans(),
        top_logprobs=st.integers(0, 3),
        tools=st.just([WEATHER]),
        tool_choice=tool_choices,
        parallel_tool_calls=st.booleans(),
        response_format=response_formats,
        reasoning_effort=st.sampled_from(["none", "low", "high"]),
        chat_template_kwargs=st.sampled_from([{"enable_thinking": True}, {"x": 1}]),
        guided_regex=st.sampled_from(["[a-z]{2}", "[a-"]),
        guided_choice=st.sampled_from([["up", "down"], []]),
        guided_json=schemas,
    ),
)
prompts = st.one_of(
    texts,
    st.lists(st.integers(0, 300), min_size=1, max_size=4),
    st.lists(texts, min_size=1, max_size=2),
    st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=3), min_size=1, max_size=2),
)
completion_bodies = st.builds(
    lambda prompt, budget, fields: {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": budget,
        **fields,
    },
    prompts,
    small_ints,
    optional(
        **sampling,
        n=st.integers(1, 2),
        best_of=st.integers(1, 3),
        stream=st.booleans(),
        stream_options=st.just({"include_usage": True}),
        echo=st.booleans(),
        logprobs=st.integers(0, 5),
        suffix=texts,
        guided_choice=st.sampled_from([["up", "down"], []]),
    ),
)


# -- Responses

RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "parameters": FORECAST}
input_items = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "developer", "assistant"]), "content": texts}
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("message"),
            "role": st.just("user"),
            "content": st.lists(st.builds(lambda t: {"type": "input_text", "text": t}, texts)),
        }
    ),
    st.just(
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hi", "annotations": []}],
        }
    ),
    st.just(
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": ARGUMENTS,
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call_output"),
            "call_id": st.just("call_1"),
            "output": texts | st.just([{"type": "input_text", "text": "18C"}]),
        }
    ),
    st.just({"type": "reasoning", "summary": [{"type": "summary_text", "text": "Think"}]}),
)
text_formats = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    st.builds(lambda schema: {"type": "json_schema", "name": "reply", "schema": schema}, schemas),
)


def responses_bodies(earlier_id: str) -> st.SearchStrategy[dict[str, Any]]:
    """Responses bodies; `earlier_id` is a stored response's, which some continue."""
    return st.builds(
        lambda input_, budget, fields: {
            "model": MODEL,
            "input": input_,
            "max_output_tokens": budget,
            **fields,
        },
        texts | st.lists(input_items, min_size=1, max_size=4),
        budgets,
        optional(
            previous_response_id=st.sampled_from([earlier_id, "resp_unknown", ""]),
            instructions=texts,
            temperature=st.sampled_from([0, 1.0]),
            top_p=st.sampled_from([0.5, 1.0]),
            tools=st.just([RESPONSES_WEATHER]),
            tool_choice=st.sampled_from(
                ["none", "auto", "required", {"type": "function", "name": "get_weather"}]
            ),
            parallel_tool_calls=st.booleans(),
            text=st.builds(lambda f: {"format": f}, text_formats),
            reasoning=st.sampled_from([{"effort": "none"}, {"effort": "high"}, {}]),
            store=st.booleans(),
            stream=st.booleans(),
            metadata=st.just({"k": "v"}),
            truncation=st.just("disabled"),
            include=st.just(["reasoning.encrypted_content"]),
        ),
    )


# -- Anthropic Messages

ANTHROPIC_WEATHER = {"name": "get_weather", "description": "Weather", "input_schema": FORECAST}
user_blocks = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, texts),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": st.just("toolu_1"),
            "content": texts | st.just([{"type": "text", "text": "18C"}]),
        },
        optional={"is_error": st.booleans()},
    ),
)
assistant_blocks = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, texts),
    st.just(
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    ),
    st.just({"type": "thinking", "thinking": "Hmm", "signature": ""}),
)
anthropic_turns = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": st.just("user"), "content": texts | st.lists(user_blocks, max_size=2)}
        ),
        st.fixed_dictionaries(
            {
                "role": st.just("assistant"),
                "content": texts | st.lists(assistant_blocks, max_size=2),
            }
        ),
    ),
    max_size=3,
).map(lambda turns: [*turns, {"role": "user", "content": "Weather in Paris?"}])
messages_bodies = st.builds(
    lambda messages, budget, fields: {
        "model": MODEL,
        "messages": messages,
        "max_tokens": budget,
        **fields,
    },
    anthropic_turns,
    budgets,
    optional(
        system=texts | st.just([{"type": "text", "text": "Be brief."}]),
        tools=st.just([ANTHROPIC_WEATHER]),
        tool_choice=st.sampled_from(
            [
                {"type": "auto"},
                {"type": "any", "disable_parallel_tool_use": True},
                {"type": "tool", "name": "get_weather"},
                {"type": "none"},
            ]
        ),
        thinking=st.sampled_from(
            [{"type": "enabled", "budget_tokens": 2}, {"type": "disabled"}, {"type": "adaptive"}]
        ),
        stop_sequences=st.sampled_from([["Hello"], []]),
        temperature=st.sampled_from([0, 1]),
        top_p=st.sampled_from([0.5, 1.0]),
        top_k=st.sampled_from([0, 5]),
        output_config=st.builds(
            lambda schema: {"format": {"type": "json_schema", "schema": schema}}, schemas
        ),
        stream=st.booleans(),
        metadata=st.just({"user_id": "u"}),
    ),
)


# -- embeddings, scores, tokens, inspection

token_lists = st.lists(st.integers(0, 263), min_size=1, max_size=4)
embedding_bodies = st.builds(
    lambda input_, fields: {"model": MODEL, "input": input_, **fields},
    st.one_of(texts, st.lists(texts, max_size=3), token_lists, st.lists(token_lists, max_size=2)),
    optional(encoding_format=st.sampled_from(["float", "base64"]), dimensions=st.integers(1, 80)),
)
rerank_bodies = st.builds(
    lambda query, documents, fields: {
        "model": MODEL,
        "query": query,
        "documents": documents,
        **fields,
    },
    texts,
    st.lists(texts, max_size=3),
    optional(top_n=small_ints, return_documents=st.booleans(), instruction=texts),
)
score_bodies = st.builds(
    lambda text_1, text_2, fields: {"model": MODEL, "text_1": text_1, "text_2": text_2, **fields},
    texts | st.lists(texts, max_size=2),
    texts | st.lists(texts, max_size=3),
    optional(instruction=texts),
)
tokenize_bodies = st.one_of(
    st.builds(
        lambda prompt, fields: {"model": MODEL, "prompt": prompt, **fields},
        texts,
        optional(add_special_tokens=st.booleans()),
    ),
    st.builds(
        lambda messages, fields: {"model": MODEL, "messages": messages, **fields},
        chat_messages,
        optional(
            add_generation_prompt=st.booleans(),
            tools=st.just([WEATHER]),
            chat_template_kwargs=st.just({"enable_thinking": False}),
        ),
    ),
)
detokenize_bodies = st.builds(
    lambda tokens: {"model": MODEL, "tokens": tokens}, st.lists(st.integers(0, 404), max_size=6)
)
inspect_bodies = st.builds(
    lambda prompt, fields: {"model": MODEL, "prompt": prompt, **fields},
    texts | st.lists(st.integers(0, 404), max_size=4) | chat_messages,
    optional(
        layers=st.lists(st.integers(0, 2), max_size=2),
        heads=st.lists(st.integers(0, 4), max_size=2),
        top_k=st.integers(0, 21),
    ),
)


# --- the fuzz ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def earlier_response(chat_app) -> str:
    """The id of a stored response that made a forced call, for `previous_response_id`."""
    body = {
        "model": MODEL,
        "input": "Weather in Paris?",
        "tools": [RESPONSES_WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 200,
        "reasoning": {"effort": "none"},
        "temperature": 0,
    }
    response = chat_app.post_json("/v1/responses", body)
    assert response.status_code == 200, response.text
    return response.json()["id"]


@FUZZ
@given(requests=batches(chat_bodies))
def test_chat_completions_never_fail_with_a_5xx(chat_app, requests):
    check(chat_app, "/v1/chat/completions", requests, ("messages",))


@FUZZ
@given(requests=batches(completion_bodies))
def test_completions_never_fail_with_a_5xx(chat_app, requests):
    check(chat_app, "/v1/completions", requests, ("prompt",))


@FUZZ
@given(data=st.data())
def test_responses_never_fail_with_a_5xx(chat_app, earlier_response, data):
    requests = data.draw(batches(responses_bodies(earlier_response)))
    check(chat_app, "/v1/responses", requests, ("input",))


@FUZZ
@given(requests=batches(messages_bodies))
def test_messages_and_their_token_counts_never_fail_with_a_5xx(chat_app, requests):
    required = ("model", "messages", "max_tokens")
    check(chat_app, "/v1/messages", requests, required)
    check(chat_app, "/v1/messages/count_tokens", requests, required[:2])


@FUZZ
@given(requests=batches(embedding_bodies))
def test_embeddings_never_fail_with_a_5xx(scoring_app, requests):
    check(scoring_app, "/v1/embeddings", requests, ("input",))


@FUZZ
@given(requests=batches(rerank_bodies))
def test_rerank_never_fails_with_a_5xx(scoring_app, requests):
    check(scoring_app, "/v1/rerank", requests, ("query", "documents"))


@FUZZ
@given(requests=batches(score_bodies))
def test_score_never_fails_with_a_5xx(scoring_app, requests):
    check(scoring_app, "/v1/score", requests, ("text_1", "text_2"))


@FUZZ
@given(tokenize=batches(tokenize_bodies), detokenize=batches(detokenize_bodies))
def test_tokenize_and_detokenize_never_fail_with_a_5xx(chat_app, tokenize, detokenize):
    check(chat_app, "/tokenize", tokenize, ("prompt", "messages"))
    check(chat_app, "/detokenize", detokenize, ("tokens",))


@FUZZ
@given(requests=batches(inspect_bodies))
def test_inspect_never_fails_with_a_5xx(chat_app, requests):
    # A prompt of chat messages: template errors name the message as `messages[i]`.
    check(chat_app, "/v1/inspect", requests, ("prompt", "messages"))


# --- cut points ----------------------------------------------------------------------------

#: What each case asks, per API: a forced call, JSON under a schema, thinking first.
CHAT_CASES = {
    "forced call": {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False},
    "json schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "f", "schema": FORECAST},
        },
        "reasoning_effort": "none",
    },
    "reasoning": {"reasoning_effort": "high"},
}
RESPONSES_CASES = {
    "forced call": {
        "tools": [RESPONSES_WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    },
    "json schema": {
        "text": {"format": {"type": "json_schema", "name": "f", "schema": FORECAST}},
        "reasoning": {"effort": "none"},
    },
    "reasoning": {"reasoning": {"effort": "high"}},
}
MESSAGES_CASES = {
    "forced call": {
        "tools": [ANTHROPIC_WEATHER],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    },
    "json schema": {
        "output_config": {"format": {"type": "json_schema", "schema": FORECAST}},
        "thinking": {"type": "disabled"},
    },
    "reasoning": {"thinking": {"type": "enabled", "budget_tokens": 100}},
}
#: Per API: its path, budget field, a request of each case, and how an answer ends:
#: (tokens generated, finish reason or status) and the end of a cut one.
CUT_APIS = {
    "chat": (
        "/v1/chat/completions",
        "max_tokens",
        lambda case: {"messages": [{"role": "user", "content": "Weather?"}], **CHAT_CASES[case]},
        lambda a: (a["usage"]["completion_tokens"], a["choices"][0]["finish_reason"]),
        "length",
    ),
    "responses": (
        "/v1/responses",
        "max_output_tokens",
        lambda case: {"input": "Weather?", **RESPONSES_CASES[case]},
        lambda a: (a["usage"]["output_tokens"], a["status"]),
        "incomplete",
    ),
    "messages": (
        "/v1/messages",
        "max_tokens",
        lambda case: {
            "messages": [{"role": "user", "content": "Weather?"}],
            **MESSAGES_CASES[case],
        },
        lambda a: (a["usage"]["output_tokens"], a["stop_reason"]),
        "max_tokens",
    ),
}


@pytest.mark.parametrize("case", sorted(CHAT_CASES))
@pytest.mark.parametrize("api", sorted(CUT_APIS))
def test_every_token_budget_cuts_the_reply_cleanly(chat_app, api, case):
    """A reply cut at each budget 1..N (N: its whole length) is a 200 that says it was
    cut; at N and past it, the reply ends as it does uncut. Streams end well-formed at
    the first budget, the middle one, N and N + 1."""
    path, budget, request, ending, cut = CUT_APIS[api]
    body = {"model": MODEL, "temperature": 0, **request(case)}
    whole = chat_app.post_json(path, {**body, budget: 400})
    assert whole.status_code == 200, whole.text
    length, end = ending(whole.json())
    assert end != cut and 1 < length < 400, (length, end)
    streamed = {1, length // 2, length, length + 1}
    bodies = [{**body, budget: k, "stream": False} for k in range(1, length + 2)]
    bodies += [{**body, budget: k, "stream": True} for k in sorted(streamed)]
    answers = chat_app.post_all(path, [json.dumps(b).encode() for b in bodies])
    assert not chat_app.errors, chat_app.errors[0].getMessage()
    for sent, answer in zip(bodies, answers, strict=True):
        assert answer.status_code == 200, (sent, answer.text)
        if sent["stream"]:
            STREAM_CHECKS[path](answer.text)
            continue
        tokens, ended = ending(answer.json())
        assert (tokens, ended) == ((sent[budget], cut) if sent[budget] < length else (length, end))
        if api == "responses" and ended == "incomplete":
            assert answer.json()["incomplete_details"] == {"reason": "max_output_tokens"}

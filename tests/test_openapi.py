"""The API as a document (issue 55): /openapi.json describes every route, and an external
fuzzer generated from that document alone finds the server as described.

schemathesis reads the served document and, for every operation, sends bodies valid by its
schemas and bodies that break them; its default checks hold on every answer: no 5xx, only
documented statuses and content types, answers that conform to the documented models
(which declare every key: `additionalProperties: false`), valid bodies accepted and
invalid ones refused; and no operation draws its "schema validation mismatch" warning.
Its stateful run follows the document's links (a created response read and deleted by
its id). Streams, which schemathesis does not read, have each event checked here against
the schema the document gives its data. The server is the embedded SmolLM2 in this process, on a
short context; each generated body names the served model and has its token budget cut to
a few tokens (`servable`), so that a valid body costs little whatever its `max_tokens` says.

The hand-written strategies of tests/server_fuzzing.py and tests/test_server_fuzz_*.py all
stay: they reach what bodies drawn from the schemas alone rarely do (forced tool calls,
JSON-schema replies and reasoning cut at every token budget, eight bodies batched at once,
bodies that are no JSON), and they assert what schemathesis does not: that a 4xx names the
field at fault, and that a stream ends as the API's clients expect.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.cli.commands.run.warnings import StatusCodeStatistic
from schemathesis.specs.openapi.checks import positive_data_acceptance
from servers import serving

import qinfer
from qinfer.core.checkpoint import resolve_model
from qinfer.engine import AsyncEngine
from qinfer.request.sampling import SamplingParams
from qinfer.server.app import ServerSettings, create_app

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores.
pytestmark = pytest.mark.slow

MODEL = "smollm2"
#: The operations left out of schemathesis' `positive_data_acceptance` (every body valid by
#: the schema is a 2xx), each for the first rule it found that JSON Schema cannot state:
#: the rule holds across fields, or against the served model (its vocabulary, its context,
#: images), so such a body is rightly a 400 naming the field. Every other operation, and
#: every other check on these, runs.
UNSTATED_RULES = {
    # an assistant's tool call's `arguments` is JSON text of an object
    "POST /v1/chat/completions": "messages.*.tool_calls.*.function.arguments",
    "POST /v1/chat/completions/render": "messages.*.tool_calls.*.function.arguments",
    "POST /tokenize": "messages.*.tool_calls.*.function.arguments",
    # a prompt of token ids within the vocabulary, that encodes to at least one token
    "POST /v1/completions": "prompt",
    "POST /v1/completions/render": "prompt",
    "POST /v1/inspect": "prompt",
    "POST /detokenize": "tokens.*: ids within the vocabulary",
    "POST /v1/embeddings": "input.*: ids within the vocabulary",
    # which blocks a role's message may hold, and the turns' order
    "POST /v1/messages": "messages.*.content",
    "POST /v1/messages/count_tokens": "messages.*.content",
    # a text input's rendered prompt is not empty; function call items pair with outputs
    "POST /v1/responses": "input",
    # as many text_2 as text_1, or one text_1
    "POST /v1/score": "text_2",
    # an integer written as a float (2.0, an integer to JSON Schema) is refused: strict
    # parsing, as for every integer field (found once the documents' bounds were stated)
    "POST /v1/rerank": "top_n",
}
#: Generated cases per operation: the issue's floor.
CASES = 40
#: Scenarios of the stateful run, and calls in each at most.
SCENARIOS, STEPS = 40, 3
#: The most tokens a generated body may ask for.
MAX_TOKENS = 4
#: The field that bounds a reply's tokens, per generating route, and whether the test
#: may add it to a body without (Anthropic's is required: a body without is invalid).
BUDGETS = {
    "/v1/chat/completions": ("max_completion_tokens", True),
    "/v1/completions": ("max_tokens", True),
    "/v1/responses": ("max_output_tokens", True),
    "/v1/messages": ("max_tokens", False),
}
FUZZ = settings(
    max_examples=CASES,
    phases=[Phase.generate],  # no shrinking: a failure is reported as found
    deadline=None,
    derandomize=True,  # the same cases on every run: CI is reproducible
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    """The embedded SmolLM2, served on a short context by the app `qinfer serve` runs."""
    path = resolve_model(None)
    tokenizer = qinfer.load_tokenizer(path)
    engine = AsyncEngine(path, tokenizer, max_model_len=256, max_num_seqs=8)
    app_settings = ServerSettings(
        model_name=MODEL, default_params=SamplingParams.from_generation_config(path)
    )
    with serving(app=create_app(engine, tokenizer, app_settings)) as server:
        yield server.url


@pytest.fixture(scope="module")
def api(served):
    return schemathesis.openapi.from_url(f"{served}/openapi.json")


def test_every_operation_documents_its_body_answer_and_errors(served):
    document = httpx.get(f"{served}/openapi.json").json()
    schemas = document["components"]["schemas"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            where = f"{method.upper()} {path}"
            answer = operation["responses"]["200"]["content"]
            if path == "/metrics":
                continue
            # every 200 is a model, whose keys are all declared
            schema = answer["application/json"]["schema"]
            name = schema.get("items", schema)["$ref"].rsplit("/", 1)[-1]
            assert schemas[name]["additionalProperties"] is False, where
            if method == "post" and path != "/flush_cache":
                body = operation["requestBody"]["content"]["application/json"]["schema"]
                assert body["properties"], where
                assert {"400", "401", "413"} <= set(operation["responses"]), where
            if "text/event-stream" in answer:  # each event's data: its model
                assert json_data_schema(answer["text/event-stream"]), where
    posts = document["paths"]["/v1/messages"]["post"]["responses"]
    error = posts["400"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/AnthropicErrorBody"}


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_nothing_from_elsewhere(served, page):
    html = httpx.get(f"{served}{page}")
    assert html.status_code == 200
    assets = re.findall(r'(?:src|href)="([^"]+)"', html.text)
    assert assets and all(url.startswith("/") for url in assets), assets
    for url in assets:
        assert httpx.get(f"{served}{url}").status_code == 200, url


def servable(case) -> None:
    """Name the served model in a generated body that names one (any other name is a
    404), and cut a generating body's token budget to MAX_TOKENS (added where the test
    may): a valid body stays valid, an invalid one keeps what makes it invalid."""
    body = case.body
    if case.method.upper() != "POST" or not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    field, may_add = BUDGETS.get(case.path, (None, False))
    value = body.get(field)
    if field and ((value is None and may_add) or (type(value) is int and value > MAX_TOKENS)):
        body[field] = MAX_TOKENS


def fuzzed(operation, statuses: Counter) -> int:
    """Run `operation`'s generated cases, each through schemathesis' default checks (a
    failed check fails the test), counting the statuses of the valid ones in `statuses`;
    how many ran."""
    modes = [GenerationMode.POSITIVE]
    if operation.body or operation.path_parameters:  # something to make invalid
        modes.append(GenerationMode.NEGATIVE)
    ran = 0

    @FUZZ
    @given(st.one_of(*(operation.as_strategy(mode) for mode in modes)))
    def run(case) -> None:
        nonlocal ran
        servable(case)
        response = case.call_and_validate(excluded_checks=excluded(operation.label))
        if case.meta.generation.mode.is_positive:
            statuses[response.status_code] += 1
        ran += 1

    run()
    return ran


def excluded(label: str) -> list:
    """The checks left out for the operation of `label` (see UNSTATED_RULES)."""
    return [positive_data_acceptance] if label in UNSTATED_RULES else []


def mismatch_warned(statuses: Counter) -> bool:
    """Whether schemathesis' CLI would warn of a "schema validation mismatch" for an
    operation whose valid cases got `statuses`: every one refused, mostly not as a 404."""
    statistic = StatusCodeStatistic(counts=dict(statuses), total=sum(statuses.values()))
    all_refused = all(400 <= status < 500 for status in statuses)
    return all_refused and statistic.should_warn_about_validation_mismatch()


def test_every_operation_answers_as_documented(api, subtests):
    for result in api.get_all_operations():
        operation = result.ok()
        with subtests.test(msg=operation.label):
            statuses: Counter = Counter()
            ran = fuzzed(operation, statuses)
            if operation.body:
                assert ran >= CASES
            assert not mismatch_warned(statuses), statuses


def test_every_documented_example_is_accepted(api, subtests):
    """Each body's example in the document is a 200 (so /docs' "Try it out" works as
    shown, and the document describes bodies the server takes)."""
    for result in api.get_all_operations():
        operation = result.ok()
        for body in operation.body:
            with subtests.test(msg=operation.label):
                example = body.definition["example"]
                case = operation.Case(body=example, media_type="application/json")
                servable(case)
                response = case.call_and_validate(excluded_checks=excluded(operation.label))
                assert response.status_code == 200, response.text


def test_created_responses_are_read_and_deleted_by_their_links(api):
    """The stateful run: sequences of calls that follow the document's links, so that a
    response POST /v1/responses created is read (GET) and deleted (DELETE) by its id."""
    called: Counter = Counter()

    class Scenarios(api.as_state_machine()):
        def before_call(self, case) -> None:
            servable(case)

        def after_call(self, response, case) -> None:
            super().after_call(response, case)
            called[f"{case.operation.label} {response.status_code}"] += 1

        def validate_response(self, response, case, additional_checks=None, **kwargs) -> None:
            case.validate_response(response, excluded_checks=excluded(case.operation.label))

    Scenarios.run(settings=settings(FUZZ, max_examples=SCENARIOS, stateful_step_count=STEPS))
    print(dict(called))
    # A link followed to a response that exists (read, or deleted before any read).
    found = ("GET", "DELETE")
    assert sum(called[f"{method} /v1/responses/{{response_id}} 200"] for method in found) > 0


#: Bodies whose answers take the rarer shapes: a forced tool call with logprobs, a prompt
#: echoed with its logprobs, a reasoning request, a tool use; each also streamed.
SHAPED_BODIES = {
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "weather",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 8}},
                        "required": ["city"],
                    },
                },
            }
        ],
        "tool_choice": "required",
        "logprobs": True,
        "top_logprobs": 2,
        "max_completion_tokens": 24,
    },
    "/v1/completions": {"prompt": "Once upon", "echo": True, "logprobs": 2, "max_tokens": 3},
    "/v1/responses": {
        "input": "Weather in Paris?",
        "tools": [
            {
                "type": "function",
                "name": "weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 8}},
                    "required": ["city"],
                },
            }
        ],
        "tool_choice": "required",
        "max_output_tokens": 24,
    },
    "/v1/messages": {
        "max_tokens": 24,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [
            {
                "name": "weather",
                "input_schema": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 8}},
                    "required": ["city"],
                },
            }
        ],
        "tool_choice": {"type": "any"},
    },
}


def json_data_schema(stream: dict) -> dict:
    """The schema of a stream's events' JSON data (OpenAI's also allow "[DONE]")."""
    data = stream["schema"]["properties"]["data"]
    return next(option for option in data.get("anyOf", [data]) if "contentSchema" in option)[
        "contentSchema"
    ]


def events(response: httpx.Response) -> list[dict]:
    """The JSON data of each event of a stream (not OpenAI's closing "[DONE]")."""
    data = [
        line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")
    ]
    return [json.loads(item) for item in data if item != "[DONE]"]


@pytest.mark.parametrize("path", SHAPED_BODIES)
def test_answers_and_stream_events_are_as_documented(served, path):
    """The JSON answer and every event of the stream of a body of each generating route
    validate against the document's schemas (the answer's, and its stream's data's)."""
    document = httpx.get(f"{served}/openapi.json").json()
    content = document["paths"][path]["post"]["responses"]["200"]["content"]

    def validator(schema: dict) -> jsonschema.Validator:
        # the document as the root, so that its references resolve
        return jsonschema.Draft202012Validator({**schema, "components": document["components"]})

    body = {"model": MODEL, **SHAPED_BODIES[path]}
    answer = httpx.post(f"{served}{path}", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    validator(content["application/json"]["schema"]).validate(answer.json())
    stream = {**body, "stream": True}
    if path == "/v1/chat/completions":
        stream["stream_options"] = {"include_usage": True}
    streamed = httpx.post(f"{served}{path}", json=stream, timeout=60)
    assert streamed.status_code == 200, streamed.text
    event_validator = validator(json_data_schema(content["text/event-stream"]))
    payloads = events(streamed)
    assert payloads
    for payload in payloads:
        event_validator.validate(payload)

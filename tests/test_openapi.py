"""The API as a document (issue 55): /openapi.json describes every route, and an external
fuzzer generated from that document alone finds the server as described.

schemathesis reads the served document and, for every operation, sends bodies valid by its
schemas and bodies that break them; its default checks hold on every answer: no 5xx, only
documented statuses and content types, bodies that conform to the documented schemas,
invalid bodies refused. Its stateful run follows the document's links (a created response
read and deleted by its id). The server is the embedded SmolLM2 in this process, on a
short context; each generated body names the served model and has its token budget cut to
a few tokens (`servable`), so that a valid body costs little whatever its `max_tokens` says.

tests/test_server_fuzz.py's hand-written strategies all stay: they reach what bodies
drawn from the schemas alone rarely do (forced tool calls, JSON-schema replies and
reasoning cut at every token budget, eight bodies batched at once, bodies that are no
JSON), and they assert what schemathesis does not: that a 4xx names the field at fault,
and that a stream ends as the API's clients expect.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
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
#: Left out of schemathesis' default checks: `positive_data_acceptance` (every body valid
#: by the schema is a 2xx). The rules across fields and against the model (no images for a
#: text model, a prompt within the context, top_logprobs only with logprobs) are not JSON
#: Schema, so such a body is rightly a 400 naming the field; the test sends instead each
#: body's documented example, which must be accepted.
EXCLUDED_CHECKS = [positive_data_acceptance]
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


def test_every_post_operation_documents_its_body_and_errors(served):
    document = httpx.get(f"{served}/openapi.json").json()
    posts = {path: ops["post"] for path, ops in document["paths"].items() if "post" in ops}
    assert len(posts) == 11
    for path, operation in posts.items():
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body["properties"], path
        assert {"200", "400", "401", "413"} <= set(operation["responses"]), path
    error = posts["/v1/messages"]["responses"]["400"]["content"]["application/json"]["schema"]
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


def fuzzed(operation) -> int:
    """Run `operation`'s generated cases, each through schemathesis' default checks (a
    failed check fails the test); how many ran."""
    modes = [GenerationMode.POSITIVE]
    if operation.body or operation.path_parameters:  # something to make invalid
        modes.append(GenerationMode.NEGATIVE)
    ran = 0

    @FUZZ
    @given(st.one_of(*(operation.as_strategy(mode) for mode in modes)))
    def run(case) -> None:
        nonlocal ran
        servable(case)
        case.call_and_validate(excluded_checks=EXCLUDED_CHECKS)
        ran += 1

    run()
    return ran


def test_every_operation_answers_as_documented(api, subtests):
    for result in api.get_all_operations():
        operation = result.ok()
        with subtests.test(msg=operation.label):
            ran = fuzzed(operation)
            if operation.body:
                assert ran >= CASES


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
                response = case.call_and_validate(excluded_checks=EXCLUDED_CHECKS)
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
            case.validate_response(response, excluded_checks=EXCLUDED_CHECKS)

    Scenarios.run(settings=settings(FUZZ, max_examples=SCENARIOS, stateful_step_count=STEPS))
    print(dict(called))
    # A link followed to a response that exists (read, or deleted before any read).
    found = ("GET", "DELETE")
    assert sum(called[f"{method} /v1/responses/{{response_id}} 200"] for method in found) > 0

"""The OpenAI-compatible server's errors, end to end: raw HTTP and the real `openai`
client against the app `qinfer serve` runs, over the real AsyncEngine on the planted Qwen3
checkpoint (tests/server_cases.py). Bad bodies, fields, models, keys, routes and sizes are
answered in OpenAI's error shape (4xx, naming the field where there is one), a full queue
with a 503, and the server keeps serving through them.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_cases import (  # noqa: F401 (fixture_*: pytest finds them here by name)
    API_KEY,
    MODEL_NAME,
    PROMPT,
    USER,
    fixture_checkpoint,
    fixture_client,
    fixture_http,
    fixture_server,
    fixture_tokenizer,
    server_app,
    stream_events,
    streamed_text,
)

from qinfer.server import schema

# --- errors -------------------------------------------------------------------------------

CHAT = {"model": MODEL_NAME, "messages": USER, "max_tokens": 4}


def assert_error(response: httpx.Response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def test_invalid_json_is_a_400(http):
    response = http.post(
        "/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
    )
    assert_error(response, 400, code="invalid_json")


def test_body_that_is_not_an_object_is_a_400(http):
    assert_error(http.post("/v1/completions", json=[1, 2]), 400, code="invalid_json")


@pytest.mark.parametrize(
    "field, value",
    [("temperature", "hot"), ("max_tokens", 2.5), ("stream", "yes"), ("n", True), ("stop", 3)],
)
def test_field_of_the_wrong_type_is_a_400_naming_it(http, field, value):
    response = http.post("/v1/chat/completions", json={**CHAT, field: value})
    assert_error(response, 400, param=field, code="invalid_value")


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 3.0),
        ("top_p", 7),
        ("max_tokens", 0),
        ("n", 100),
        ("top_logprobs", 50),
        ("presence_penalty", -5),
        ("seed", -1),
        ("seed", 2**64),
        ("top_k", 2**63),  # past int64: it would fail the engine step and its whole batch
        ("guided_choice", []),
    ],
)
def test_out_of_range_value_is_a_400_naming_it(http, field, value):
    body = {**CHAT, field: value, **({"logprobs": True} if field == "top_logprobs" else {})}
    assert_error(
        http.post("/v1/chat/completions", json=body), 400, param=field, code="invalid_value"
    )


def test_too_many_stop_strings_is_a_400_but_a_long_one_is_fine(http):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2}
    too_many = http.post("/v1/completions", json={**body, "stop": ["a"] * 17})
    assert_error(too_many, 400, param="stop", code="invalid_value")
    long_one = http.post(
        "/v1/completions", json={**body, "stop": "a stop string of 34 characters..."}
    )
    assert long_one.status_code == 200, long_one.text


def test_unknown_field_is_ignored_and_logged_once(http, caplog, monkeypatch):
    """As vLLM does: clients send fields of newer API versions by default."""
    # the memo is the process's: earlier modules' fuzzing may have filled it
    monkeypatch.setattr(schema, "_logged_unknown_fields", set())
    body = {**CHAT, "temprature": 0.5, "stream_options_v2": {"x": 1}}
    with caplog.at_level("WARNING", logger="qinfer.server"):
        first = http.post("/v1/chat/completions", json=body)
        second = http.post("/v1/chat/completions", json=body)
    assert first.status_code == second.status_code == 200, first.text
    logged = [r.getMessage() for r in caplog.records if "unknown field" in r.getMessage()]
    assert sorted(logged) == [
        "ignoring the unknown field 'stream_options_v2' of ChatCompletionRequest (logged once)",
        "ignoring the unknown field 'temprature' of ChatCompletionRequest (logged once)",
    ]


def test_missing_messages_is_a_400(http):
    response = http.post("/v1/chat/completions", json={"model": MODEL_NAME})
    assert_error(response, 400, param="messages", code="missing_required_parameter")


def test_bad_message_role_is_a_400_naming_the_message(http):
    response = http.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "robot"}]})
    assert_error(response, 400, param="messages.0.role")


def test_template_kwargs_cannot_replace_the_messages(http):
    body = {**CHAT, "chat_template_kwargs": {"messages": []}}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param="chat_template_kwargs")


def test_unknown_model_is_a_404(http):
    response = http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
    assert_error(response, 404, param="model", code="model_not_found")


def test_prompt_longer_than_the_context_is_a_400(http):
    response = http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": "fox " * 600, "max_tokens": 1}
    )
    assert_error(response, 400)


def test_token_id_outside_the_vocabulary_is_a_400(http):
    response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [1, 10**6]})
    assert_error(response, 400)


def test_oversized_body_is_a_413(http):
    response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x" * 17_000_000})
    assert_error(response, 413, code="request_too_large")


def test_oversized_body_sent_in_chunks_is_a_413(http):
    def chunks():  # no Content-Length: the server counts as it reads
        for _ in range(17):
            yield b"x" * 2**20

    response = http.post("/v1/completions", content=chunks())
    assert_error(response, 413, code="request_too_large")


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}]
)
def test_missing_or_wrong_api_key_is_a_401(server, headers):
    response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, headers=headers)
    assert_error(response, 401, code="invalid_api_key")


def test_openai_client_raises_its_own_error_types(server, client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=USER)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=USER, temperature=9)
    wrong_key = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()


def test_unknown_route_is_a_json_404(http):
    assert_error(http.get("/v1/engines"), 404)


def test_burst_of_bad_requests_leaves_a_concurrent_stream_intact(server, http):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 1.0, "max_tokens": 40, "seed": 5}
    bad_bodies = [b"{", b"[]", b'{"prompt": 5}', b'{"model": "x", "prompt": "a"}'] * 8

    def bad(payload):
        headers = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
        return httpx.post(
            f"{server.url}/v1/completions", content=payload, headers=headers
        ).status_code

    with ThreadPoolExecutor(4) as pool:
        stream = pool.submit(stream_events, http, "/v1/completions", body)
        statuses = list(pool.map(bad, bad_bodies))
        events = stream.result()
    assert set(statuses) == {400, 404}
    assert (
        streamed_text(events)
        == http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    )


def test_full_queue_answers_503_and_the_server_keeps_serving(checkpoint, tokenizer, serve):
    app, _ = server_app(checkpoint, tokenizer, max_num_seqs=1, max_waiting_requests=1)
    running = serve(app=app)
    client = openai.OpenAI(base_url=f"{running.url}/v1", api_key=API_KEY, max_retries=0)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 200}
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def burst():
        async with httpx.AsyncClient(base_url=running.url, headers=headers, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(6)))

    responses = asyncio.run(burst())
    refused = [r for r in responses if r.status_code == 503]
    assert refused and all(r.status_code in (200, 503) for r in responses)
    assert_error(refused[0], 503, code="overloaded")
    after = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert after.choices[0].finish_reason == "length"

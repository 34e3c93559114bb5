"""The request fields and small endpoints clients send besides the core ones, against
`qinfer serve` on a random Qwen3 whose vocabulary holds Qwen's fill-in-the-middle tokens:
logit_bias, echo, suffix, reasoning_effort, the fields accepted and not acted on, unknown
fields (ignored, logged once), fields qinfer cannot honour (a 400 naming them),
/tokenize and /detokenize, CORS and several API keys.

Expected outputs come from `qinfer.generate` on the same checkpoint, or from the
tokenizer itself, never from the server.
"""

from __future__ import annotations

import os
import time

import httpx
import openai
import pytest
import torch
from checkpoints import build_checkpoint
from servers import serving
from text_assets import (
    CHATML_SPECIAL,
    QWEN3_ADDED,
    save_qwen3_tokenizer,
    save_tokenizer_folder,
    train_tokenizer,
)

import qinfer
from qinfer.cli import main
from qinfer.engine.generation import generate
from qinfer.request.sampling import SamplingParams
from qinfer.text.fill_in_middle import fim_tokens
from qinfer.text.prompts import encode_prompt

MODEL = "tiny-fim"
KEYS = ["key-one", "key-two", "key-three"]  # the first by --api-key, the others from a file
ORIGIN = "http://app.example"
FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
PROMPT = "The quick brown fox"
USER = [{"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-fim")
    backend = train_tokenizer(CHATML_SPECIAL, QWEN3_ADDED + FIM)
    save_qwen3_tokenizer(folder, backend)
    eos = backend.token_to_id("<|im_end|>")
    build_checkpoint(folder, "qwen3", vocab_size=backend.get_vocab_size(), eos_token_id=eos)
    return folder


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return qinfer.load_tokenizer(checkpoint)


@pytest.fixture(scope="module")
def model(checkpoint):
    return qinfer.load_model(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    """The `qinfer serve` process and its URL (its stderr readable without blocking)."""
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"{KEYS[1]}\n\n  {KEYS[2]}  \n")
    with serving(
        *("--model", str(checkpoint), "--served-model-name", MODEL, "--dtype", "float32"),
        *("--api-key", KEYS[0], "--api-key-file", str(key_file), "--allowed-origins", ORIGIN),
    ) as server:
        os.set_blocking(server.process.stderr.fileno(), False)
        yield server.process, server.url


@pytest.fixture(scope="module")
def http(served):
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    with httpx.Client(base_url=served[1], headers=headers, timeout=120) as http:
        yield http


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key=KEYS[1], max_retries=0, timeout=120)


def complete(http, **fields) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def assert_400(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"], error


# --- logit_bias ----------------------------------------------------------------------------


def test_a_bias_of_100_makes_every_token_that_token(http, client, tokenizer):
    lazy = tokenizer.encode(" lazy", add_special_tokens=False)[0]
    text = complete(http, logit_bias={str(lazy): 100})["choices"][0]["text"]
    assert text == tokenizer.decode([lazy] * 6)
    reply = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=4, temperature=0, logit_bias={str(lazy): 100}
    )
    assert reply.choices[0].message.content == tokenizer.decode([lazy] * 4)


def test_logit_bias_matches_offline_generate(http, model, tokenizer):
    plain = generate(model, tokenizer, PROMPT, SamplingParams(temperature=0, max_tokens=6))
    banned = plain.token_ids[0]  # the greedy first token, banned; two others favoured
    bias = {banned: -100, banned + 1: 5.0, banned + 2: 4.5}
    params = SamplingParams(temperature=0, max_tokens=6, logit_bias=bias)
    expected = generate(model, tokenizer, PROMPT, params)
    served = complete(http, logit_bias={str(t): b for t, b in bias.items()})["choices"][0]
    assert served["text"] == expected.text != plain.text
    assert banned not in tokenizer.encode(served["text"], add_special_tokens=False)[:1]


@pytest.mark.parametrize(
    "bias", [{"abc": 1}, {"-3": 1}, {"1": 101}, {"1": "strong"}, {"100000": 1}, [1, 2]]
)
def test_a_bad_logit_bias_is_a_400_naming_it(http, bias):
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": USER}),
    ):
        response = http.post(
            path, json={"model": MODEL, "max_tokens": 2, "logit_bias": bias, **body}
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"].startswith("logit_bias")


def test_sampling_params_refuse_a_bad_logit_bias():
    with pytest.raises(qinfer.QinferError, match="logit_bias"):
        SamplingParams(logit_bias={3: 150})
    with pytest.raises(qinfer.QinferError, match="logit_bias"):
        SamplingParams(logit_bias={"3": 1})


# --- echo, suffix ------------------------------------------------------------------------


def test_echo_prepends_each_prompt_to_its_text(http, tokenizer):
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    plain = complete(http, prompt=[PROMPT, PROMPT])["choices"][0]["text"]
    echoed = complete(http, prompt=[PROMPT, PROMPT], echo=True)["choices"]
    assert [c["text"] for c in echoed] == [PROMPT + plain] * 2
    from_ids = complete(http, prompt=ids, echo=True)["choices"][0]["text"]
    assert from_ids.startswith(tokenizer.decode(ids))
    with http.stream(
        "POST",
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 6,
            "temperature": 0,
            "echo": True,
            "stream": True,
        },
    ) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [httpx.Response(200, content=line).json() for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + plain


def test_suffix_fills_the_middle_between_prompt_and_suffix(http, model, tokenizer):
    before, after = "def add(a, b):\n", "\n    return c\n"
    framed = f"<|fim_prefix|>{before}<|fim_suffix|>{after}<|fim_middle|>"
    served = complete(http, prompt=before, suffix=after)
    expected = generate(model, tokenizer, framed, SamplingParams(temperature=0, max_tokens=6))
    assert served["choices"][0]["text"] == expected.text
    assert served["usage"]["prompt_tokens"] == len(tokenizer.encode(framed))
    assert tokenizer.token_to_id("<|fim_middle|>") == tokenizer.encode(framed)[-1]  # one token
    ids = tokenizer.encode(before, add_special_tokens=False)
    assert_400(
        http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "suffix": after}),
        "suffix",
    )


@pytest.mark.parametrize(
    "vocabulary, prefix",
    [
        (FIM, "<|fim_prefix|>"),  # Qwen2.5-Coder, Qwen3
        (
            ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"],
            "<fim_prefix>",
        ),  # StarCoder
        (["<fim_prefix>", "<fim_middle>"], None),  # not the whole set
        ([], None),  # SmolLM2's kind: no FIM tokens at all
    ],
)
def test_fim_tokens_are_found_in_the_vocabulary(tmp_path, vocabulary, prefix):
    save_tokenizer_folder(tmp_path, train_tokenizer(CHATML_SPECIAL, vocabulary))
    tokens = fim_tokens(qinfer.load_tokenizer(tmp_path))
    assert (tokens and tokens.prefix) == prefix


# --- reasoning_effort and the fields accepted --------------------------------------------


def prompt_tokens(http, enable_thinking: bool) -> int:
    body = {
        "model": MODEL,
        "messages": USER,
        "chat_template_kwargs": {"enable_thinking": enable_thinking},
    }
    return http.post("/tokenize", json=body).json()["count"]


@pytest.mark.parametrize(
    "effort, thinks", [("none", False), ("minimal", False), ("low", True), ("high", True)]
)
def test_reasoning_effort_turns_thinking_on_or_off(client, http, effort, thinks):
    reply = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=1, reasoning_effort=effort
    )
    assert reply.usage.prompt_tokens == prompt_tokens(http, thinks)
    assert prompt_tokens(http, True) != prompt_tokens(http, False)


def test_fields_clients_send_by_default_are_accepted(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=2,
        store=True,
        metadata={"run": "tests"},
        service_tier="auto",
        user="someone",
        seed=3,
        parallel_tool_calls=False,
        modalities=["text"],
    )
    assert reply.choices[0].finish_reason == "length"


def stderr_text(process) -> str:
    chunks = []
    while (chunk := process.stderr.read()) is not None and chunk:
        chunks.append(chunk)
    return b"".join(chunks).decode()


def test_unknown_fields_are_ignored_and_logged_once(served, http):
    process = served[0]
    stderr_text(process)  # what it said so far
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, "verbosity_v9": "low"}
    for _ in range(3):
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    deadline, said = time.monotonic() + 10, ""
    while "verbosity_v9" not in said and time.monotonic() < deadline:
        time.sleep(0.1)
        said += stderr_text(process)
    assert said.count("unknown field 'verbosity_v9'") == 1, said


@pytest.mark.parametrize(
    "field, value",
    [
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("prediction", {"type": "content", "content": "x"}),
        ("modalities", ["text", "audio"]),
        ("functions", [{"name": "f"}]),
        ("reasoning_effort", "extreme"),
        ("metadata", {"a": 1}),
    ],
)
def test_a_field_qinfer_cannot_honour_is_a_400_naming_it(http, field, value):
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, field: value}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].split(".")[0] == field


# --- /tokenize, /detokenize ----------------------------------------------------------------


def test_tokenize_a_prompt_and_a_chat_then_detokenize(http, tokenizer):
    answer = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert answer["tokens"] == tokenizer.encode(PROMPT) and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] > 0
    chat = http.post("/tokenize", json={"messages": USER}).json()["tokens"]
    assert chat == encode_prompt(tokenizer, USER)
    bare = http.post("/tokenize", json={"messages": USER, "add_generation_prompt": False})
    assert len(bare.json()["tokens"]) < len(chat)
    text = http.post("/detokenize", json={"model": MODEL, "tokens": chat}).json()["prompt"]
    assert text == tokenizer.decode(chat) and "Hello world" in text


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/detokenize", {"tokens": [1, -1]}, "tokens.1"),
        ("/detokenize", {"tokens": [10**6]}, "tokens.0"),
        ("/detokenize", {"tokens": ["a"]}, "tokens.0"),
        ("/tokenize", {"prompt": 5}, "prompt"),
    ],
)
def test_bad_tokenize_input_is_a_400_naming_it(http, path, body, param):
    assert_400(http.post(path, json=body), param)
    neither = http.post("/tokenize", json={"model": MODEL})
    assert neither.status_code == 400 and "prompt or messages" in neither.text
    assert http.post("/tokenize", json={"model": "gpt-9", "prompt": "x"}).status_code == 404


# --- CORS, API keys ----------------------------------------------------------------------


def test_cors_lets_the_allowed_origin_in_and_no_other(served):
    url = served[1]
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization",
    }
    allowed = httpx.options(f"{url}/v1/chat/completions", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(
        f"{url}/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight}
    )
    assert "access-control-allow-origin" not in other.headers
    answer = httpx.get(
        f"{url}/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEYS[2]}"}
    )
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ORIGIN


def test_every_key_of_the_flag_and_the_file_is_accepted(served):
    url = served[1]
    for key in KEYS:
        assert (
            httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code
            == 200
        )
    for headers in ({}, {"Authorization": "Bearer key-four"}):
        assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 401
        assert (
            httpx.post(f"{url}/tokenize", json={"prompt": "x"}, headers=headers).status_code == 401
        )


def test_an_unreadable_or_empty_key_file_is_refused(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    for path, reason in ((tmp_path / "missing.txt", "cannot read"), (empty, "holds no key")):
        assert main(["serve", "--api-key-file", str(path)]) != 0
        error = capsys.readouterr().err.strip()
        assert "--api-key-file" in error and reason in error and "\n" not in error


def test_the_server_keeps_serving_after_the_bad_requests(http):
    assert complete(http)["choices"][0]["finish_reason"] == "length"

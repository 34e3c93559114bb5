"""LoRA adapters over HTTP (`qinfer.server.vllm.lora`, `ModelServer.check_model`): an
adapter is a model requests name, as vLLM serves them (`--lora-modules`), `/v1/models`
lists it under its base, and `--allow-runtime-lora` loads and unloads adapters while other
requests stream. The reference is `LLM.generate` through the same adapter (itself held to
transformers + peft in tests/test_lora.py)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from checkpoints import ALL, ATTENTION, save_lora_adapter
from servers import serving

from qinfer.engine import LLM, AsyncEngine
from qinfer.request.sampling import SamplingParams
from qinfer.server.app import ServerSettings, create_app

pytest.importorskip("peft")

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores.
pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3"
PROMPT = [5, 17, 42, 99, 7, 64, 23, 11]


@pytest.fixture(scope="module")
def adapters(qwen3_chat_folder, tmp_path_factory):
    """Two PEFT adapters over the chat checkpoint: name -> folder."""
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(qwen3_chat_folder).float()
    root = tmp_path_factory.mktemp("server-adapters")
    for seed, (name, targets) in enumerate((("a0", ALL), ("a1", ATTENTION))):
        save_lora_adapter(reference, root / name, targets, r=8, seed=30 + seed)
    return {"a0": str(root / "a0"), "a1": str(root / "a1")}


@pytest.fixture(scope="module")
def http(qwen3_chat_folder, adapters):
    engine = AsyncEngine(
        qwen3_chat_folder,
        dtype="float32",
        batch_invariant=True,
        lora_modules={"a0": adapters["a0"]},
        max_loras=2,
    )
    settings = ServerSettings(model_name=MODEL, allow_runtime_lora=True)
    with serving(app=create_app(engine, engine.tokenizer, settings)) as running:
        with httpx.Client(base_url=running.url, timeout=120) as client:
            yield client


@pytest.fixture(scope="module")
def expected(qwen3_chat_folder, adapters):
    """LLM.generate's greedy text of PROMPT through each adapter and the base."""
    llm = LLM(qwen3_chat_folder, dtype=torch.float32, batch_invariant=True, lora_modules=adapters)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    names = [None, "a0", "a1"]
    outputs = llm.generate([PROMPT] * 3, params, use_tqdm=False, lora=names)
    return {name: output.text for name, output in zip(names, outputs, strict=True)}


def complete(http, model: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    return http.post("/v1/completions", json={**body, "ignore_eos": True})


def assert_error(response: httpx.Response, status: int, param: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and "\n" not in error["message"]
    return error["message"]


def test_models_list_the_adapters_under_the_base(http, adapters):
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert models["a0"]["parent"] == MODEL and models["a0"]["root"] == adapters["a0"]
    assert "parent" not in models[MODEL]


def test_model_names_the_adapter(http, expected):
    for name in (None, "a0"):
        answer = complete(http, name or MODEL)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == expected[name], name
        assert answer.json()["model"] == (name or MODEL)
    assert expected["a0"] != expected[None]
    chat = http.post(
        "/v1/chat/completions",
        json={"model": "a0", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert chat.status_code == 200 and chat.json()["model"] == "a0"


def test_unknown_adapter_is_a_404_naming_model(http):
    message = assert_error(complete(http, "nope"), 404, "model")
    assert "'nope' does not exist" in message and "'a0'" in message
    tokenize = http.post("/tokenize", json={"model": "a0", "prompt": "hi"})
    assert_error(tokenize, 400, "model")  # a base-model route


def test_load_and_unload_while_another_request_streams(http, adapters, expected):
    streamed: list[str] = []

    def stream() -> None:
        body = {"model": "a0", "prompt": PROMPT, "max_tokens": 60, "temperature": 0}
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as answer:
            assert answer.status_code == 200
            streamed.extend(line for line in answer.iter_lines() if line)

    running = threading.Thread(target=stream)
    running.start()
    loaded = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": adapters["a1"]}
    )
    assert loaded.status_code == 200, loaded.text
    assert complete(http, "a1").json()["choices"][0]["text"] == expected["a1"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 200
    running.join()
    assert streamed[-1] == "data: [DONE]"
    assert_error(complete(http, "a1"), 404, "model")
    again = http.post("/v1/unload_lora_adapter", json={"lora_name": "a1"})
    assert_error(again, 404, "lora_name")
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
    assert "/nowhere" in assert_error(bad, 400, "lora_path")
    duplicate = {"lora_name": "a0", "lora_path": adapters["a0"]}
    assert "already loaded" in assert_error(
        http.post("/v1/load_lora_adapter", json=duplicate), 400, "lora_path"
    )


def test_one_slot_evicts_or_waits_while_in_use(qwen3_chat_folder, adapters, expected):
    """--max-loras 1 with a0 and a1 loaded: a request for the evicted adapter makes it
    resident again (the other evicted), and gives LLM.generate's text; while a request
    streams through a0, a load of a third adapter answers 503 in one line and a request
    for a1 waits for the slot: it ends after the stream, with a1's text."""
    engine = AsyncEngine(
        qwen3_chat_folder, dtype="float32", batch_invariant=True, lora_modules=adapters, max_loras=1
    )
    settings = ServerSettings(model_name=MODEL, allow_runtime_lora=True)
    with serving(app=create_app(engine, engine.tokenizer, settings)) as running:
        with httpx.Client(base_url=running.url, timeout=120) as http:
            for name in ("a0", "a1", "a0"):  # a1 evicted when a0 asked for: in turn
                answer = complete(http, name)
                assert answer.json()["choices"][0]["text"] == expected[name], name
            body = {"model": "a0", "prompt": PROMPT, "max_tokens": 480, "temperature": 0}
            third = {"lora_name": "a2", "lora_path": adapters["a1"]}
            with http.stream(
                "POST", "/v1/completions", json={**body, "ignore_eos": True, "stream": True}
            ) as streaming:
                lines = streaming.iter_lines()
                assert next(line for line in lines if line).startswith("data: ")  # running
                waiting = ThreadPoolExecutor(1).submit(complete, http, "a1")
                loading = http.post("/v1/load_lora_adapter", json=third)
                assert "'a2' resident" in assert_error(loading, 503, None)
                assert not waiting.done()
                assert [line for line in lines if line][-1] == "data: [DONE]"
            assert waiting.result().json()["choices"][0]["text"] == expected["a1"]
            assert http.post("/v1/load_lora_adapter", json=third).status_code == 200
            assert http.get("/v1/models").status_code == 200

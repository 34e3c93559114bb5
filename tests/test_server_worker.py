"""What a router asks of a replica (`qinfer.server.worker`, `qinfer.server.vllm.render`,
the vLLM-named gauges): load in SMG's `WorkerLoadResponse` shape, the prefix cache
flushed, server and model info, prompts rendered to token ids, all behind the API key.

The app runs in this process over a random Qwen3 with the ChatML byte tokenizer; the
references are the engine's own counters (`/metrics`, read the way Prometheus reads
them), `/tokenize`, and the pool's configured size.
"""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import metric_values, serving, wait_until_idle

from qinfer.engine import AsyncEngine
from qinfer.server.app import ServerSettings, create_app

KEY = "worker-key"
MODEL = "tiny-qwen3"
BLOCKS, BLOCK_SIZE, MAX_SEQS = 96, 16, 4
# A system prompt of several full blocks, as a long shared system prompt is.
SYSTEM = "You are a terse assistant who answers in one line. " * 6


@pytest.fixture(scope="module")
def engine(qwen3_chat_folder):
    return AsyncEngine(
        qwen3_chat_folder,
        dtype="float32",
        num_kv_blocks=BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_SEQS,
        max_model_len=500,  # under the checkpoint's 512
    )


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(engine, engine.tokenizer, ServerSettings(model_name=MODEL, api_key=KEY))
    with serving(app=app) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as http:
        yield http


def chat(http: httpx.Client, user: str, max_tokens: int = 2) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def assert_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and "\n" not in error["message"]


# --- /v1/loads ------------------------------------------------------------------------


def test_loads_answer_in_smgs_worker_load_response_shape(http):
    chat(http, "first question")
    chat(http, "second question")  # the system prompt's blocks come from the cache
    metrics = wait_until_idle(http)
    answer = http.get("/v1/loads", params={"include": "core,queues,memory"}).json()
    assert set(answer) == {"timestamp", "version", "dp_rank_count", "loads", "aggregate"}
    assert answer["dp_rank_count"] == 1 and len(answer["loads"]) == 1
    load = answer["loads"][0]
    assert load["dp_rank"] == 0
    assert load["num_running_reqs"] == load["num_waiting_reqs"] == 0
    assert load["max_total_num_tokens"] == BLOCKS * BLOCK_SIZE
    assert load["num_used_tokens"] == 0 and load["token_usage"] == 0.0
    assert load["max_running_requests"] == MAX_SEQS
    assert load["cache_hit_rate"] == pytest.approx(metrics["qinfer_prefix_cache_hit_rate"])
    assert load["cache_hit_rate"] > 0
    assert load["gen_throughput"] >= 0
    assert load["queues"]["waiting"] == 0
    memory = load["memory"]
    assert memory["token_capacity"] == BLOCKS * BLOCK_SIZE
    assert memory["weight_gb"] > 0 and memory["kv_cache_gb"] > 0
    assert answer["aggregate"]["total_reqs"] == 0


def test_loads_leave_out_the_sections_not_asked_for(http):
    load = http.get("/v1/loads", params={"include": "core"}).json()["loads"][0]
    assert "memory" not in load and "queues" not in load
    everything = http.get("/v1/loads").json()["loads"][0]
    assert "memory" in everything and "queues" in everything


def test_loads_count_running_requests_and_their_tokens(http):
    """A request streaming (long max_tokens) shows as running, holding KV tokens, from
    the engine's snapshot after its next step."""
    body = {"model": MODEL, "prompt": "count", "max_tokens": 400, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        for _ in response.iter_lines():
            load = http.get("/v1/loads").json()["loads"][0]
            if load["num_running_reqs"]:
                break
    assert load["num_running_reqs"] == 1 and load["utilization"] == 1 / MAX_SEQS
    assert load["num_used_tokens"] > 0
    assert load["token_usage"] == load["num_used_tokens"] / (BLOCKS * BLOCK_SIZE)
    wait_until_idle(http)


def test_an_unknown_load_section_is_a_400_naming_include(http):
    assert_error(http.get("/v1/loads", params={"include": "core,bogus"}), 400, "include")
    assert_error(http.get("/v1/loads", params={"include": ""}), 400, "include")
    assert http.get("/health").status_code == 200


# --- /flush_cache ---------------------------------------------------------------------


def test_flush_cache_forgets_the_cached_prefixes(http):
    chat(http, "a question to cache")
    cached = wait_until_idle(http)["qinfer_kv_blocks_cached"]
    assert cached > 0
    answer = http.post("/flush_cache").json()
    assert answer["dropped_blocks"] == cached and answer["kept_blocks"] == 0
    assert answer["running_requests"] == 0 and answer["block_size"] == BLOCK_SIZE
    assert metric_values(http)["qinfer_kv_blocks_cached"] == 0
    hits = metric_values(http)["qinfer_prefix_cache_hits_total"]
    chat(http, "a question to cache")  # computed afresh: not one token from the cache
    assert wait_until_idle(http)["qinfer_prefix_cache_hits_total"] == hits


def test_flush_cache_with_a_request_running_keeps_its_blocks_and_the_request(
    http, engine, monkeypatch
):
    chat(http, "warm the cache")
    wait_until_idle(http)
    # Each step a little slower, so that the request is still running when the flush comes
    # (the tiny model's 60 tokens could otherwise all be out before it).
    step = engine.engine.step
    monkeypatch.setattr(engine.engine, "step", lambda: time.sleep(0.02) or step())
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "go"}],
        "max_tokens": 60,
        "temperature": 0,
        "stream": True,
    }
    lines = []
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        iterator = response.iter_lines()
        lines.append(next(iterator))  # running, holding the system prompt's cached blocks
        answer = http.post("/flush_cache")
        lines.extend(line for line in iterator if line)
    assert answer.status_code == 200
    flush = answer.json()
    assert flush["running_requests"] == 1 and flush["kept_blocks"] > 0
    assert str(flush["kept_blocks"]) in flush["message"]
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in "".join(lines)


# --- /server_info, /model_info --------------------------------------------------------


def test_server_and_model_info_under_both_spellings(http):
    for path in ("/server_info", "/model_info"):
        answer = http.get(path).json()
        assert http.get(f"/get{path.replace('/', '_')}").json().keys() == answer.keys()
    info = http.get("/server_info").json()
    assert info["served_model_name"] == MODEL and info["page_size"] == BLOCK_SIZE
    assert info["max_total_num_tokens"] == BLOCKS * BLOCK_SIZE
    assert info["max_running_requests"] == MAX_SEQS and info["enable_prefix_caching"]
    model = http.get("/model_info").json()
    assert model["model_type"] == "qwen3" and model["is_generation"]
    assert model["max_model_len"] == 500
    assert http.get("/v1/models").json()["data"][0]["owned_by"] == "qinfer"


# --- render ---------------------------------------------------------------------------


def test_chat_render_gives_the_ids_a_chat_request_runs(http):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    rendered = http.post(
        "/v1/chat/completions/render",
        json={"model": MODEL, "messages": messages, "temperature": 0.5, "max_tokens": 9},
    ).json()
    tokenized = http.post("/tokenize", json={"messages": messages}).json()
    assert rendered["token_ids"] == tokenized["tokens"]
    assert rendered["model"] == MODEL and rendered["request_id"].startswith("chatcmpl-")
    usage = chat(http, "hi")["usage"]
    assert usage["prompt_tokens"] == len(rendered["token_ids"])


def test_completion_render_gives_one_rendering_per_prompt(http):
    prompts = ["Once upon a time", "The end"]
    rendered = http.post("/v1/completions/render", json={"prompt": prompts}).json()
    assert [r["token_ids"] for r in rendered] == [
        http.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts
    ]
    assert all(r["request_id"].startswith("cmpl-") for r in rendered)


def test_render_refuses_bad_bodies_as_the_generation_routes_do(http):
    bad = {"model": MODEL, "prompt": "x", "max_tokens": -1}
    assert_error(http.post("/v1/completions/render", json=bad), 400, "max_tokens")
    assert_error(
        http.post("/v1/chat/completions/render", json={"model": MODEL, "messages": []}),
        400,
        "messages",
    )
    wrong_model = {"model": "another", "prompt": "x"}
    assert http.post("/v1/completions/render", json=wrong_model).status_code == 404


# --- metrics, API key -----------------------------------------------------------------


def test_router_gauges_also_go_out_under_vllms_names(http):
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    ours = metric_values(http)
    pairs = {
        "vllm:num_requests_running": "qinfer_requests_running",
        "vllm:num_requests_waiting": "qinfer_requests_waiting",
        "vllm:kv_cache_usage_perc": "qinfer_kv_cache_usage_ratio",
    }
    for vllm_name, name in pairs.items():
        (sample,) = families[vllm_name].samples
        assert sample.labels == {"model_name": MODEL}
        assert sample.value == ours[name]


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/loads"),
        ("POST", "/flush_cache"),
        ("GET", "/server_info"),
        ("GET", "/get_model_info"),
        ("POST", "/v1/chat/completions/render"),
        ("POST", "/v1/completions/render"),
    ],
)
def test_router_routes_need_the_api_key(server, method, path):
    response = httpx.request(method, f"{server.url}{path}", json={"prompt": "x"})
    assert_error(response, 401, None)
    wrong = httpx.request(method, f"{server.url}{path}", headers={"x-api-key": "no"})
    assert wrong.status_code == 401

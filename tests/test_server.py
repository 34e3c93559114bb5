"""The OpenAI-compatible server, end to end: the real `openai` client and raw HTTP against
the app `qinfer serve` runs, over the real AsyncEngine on a random Qwen3 checkpoint.

The checkpoint is random except for one planted path (tests/planted_qwen3.py): after "\\n"
the model always writes `<think>The answer</think>\\n\\nHello<|im_end|>` (a Qwen3 thinking
reply), and after the "\\n\\n" that closes Qwen3's empty think block
(`enable_thinking=False`) it writes `Hello<|im_end|>`. Anywhere else it writes random text
and, in practice, never stops before max_tokens. Expected outputs come from
`qinfer.generate` (the single-request generator, greedy) and from `transformers`
(logprobs), never from the server itself.

Errors are tested in tests/test_server_errors.py; the checkpoint, the server and the
clients of it come from tests/server_cases.py.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
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
    stream_events,
    streamed_text,
)
from servers import metric_values, wait_until_idle

import qinfer
from qinfer.cli import main
from qinfer.engine.generation import generate
from qinfer.request.sampling import SamplingParams


@pytest.fixture(scope="module")
def model(checkpoint):
    return qinfer.load_model(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def offline(model, tokenizer, prompt, chat=False, **params_and_template):
    """The reference: `qinfer.generate` on the same checkpoint (no engine, no server)."""
    template = {k: v for k, v in params_and_template.items() if k == "enable_thinking"}
    params = {k: v for k, v in params_and_template.items() if k != "enable_thinking"}
    return generate(model, tokenizer, prompt, SamplingParams(**params), chat=chat, **template)


# --- models, health -----------------------------------------------------------------------


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_health_answers_without_api_key(server):
    response = httpx.get(f"{server.url}/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


# --- chat ---------------------------------------------------------------------------------


def test_chat_follows_server_default_without_thinking(client, model, tokenizer):
    reply = client.chat.completions.create(model=MODEL_NAME, messages=USER, temperature=0)
    expected = offline(model, tokenizer, USER, chat=True, temperature=0, enable_thinking=False)
    message = reply.choices[0].message
    assert message.content == expected.text == "Hello"
    assert getattr(message, "reasoning_content", None) is None
    assert reply.choices[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def thinking_chat(client, model, tokenizer):
    """(the server's greedy reply to USER with thinking on, `offline`'s result for it)."""
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    expected = offline(model, tokenizer, USER, chat=True, temperature=0, enable_thinking=True)
    return reply, expected


def test_chat_with_thinking_puts_reasoning_in_reasoning_content(thinking_chat):
    reply, expected = thinking_chat
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == (expected.reasoning, expected.answer)
    assert (expected.reasoning, expected.answer) == ("The answer", "Hello")


def test_chat_usage_counts_prompt_and_completion_tokens(thinking_chat):
    reply, expected = thinking_chat
    assert reply.usage.prompt_tokens == expected.prompt_tokens
    assert reply.usage.completion_tokens == expected.generated_tokens
    assert reply.usage.total_tokens == expected.prompt_tokens + expected.generated_tokens


def test_chat_logprobs_match_transformers(client, tokenizer, hf_model):
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(USER, enable_thinking=True), add_special_tokens=False
    )
    entries = reply.choices[0].logprobs.content
    # Greedy: each token is the reference's argmax given the ones before it.
    tokens = list(prompt)
    with torch.no_grad():
        for entry in entries:
            logprobs = torch.log_softmax(hf_model(torch.tensor([tokens])).logits[0, -1].float(), -1)
            top = torch.topk(logprobs, 3)
            best = int(top.indices[0])
            assert entry.token == tokenizer.decode([best])
            assert entry.logprob == pytest.approx(float(top.values[0]), abs=1e-4)
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
                top.values.tolist(), abs=1e-4
            )
            assert entry.bytes == list(entry.token.encode())
            tokens.append(best)
    assert len(entries) == reply.usage.completion_tokens


def test_chat_n_returns_n_choices(client):
    reply = client.chat.completions.create(model=MODEL_NAME, messages=USER, temperature=0, n=2)
    assert [(c.index, c.message.content) for c in reply.choices] == [(0, "Hello"), (1, "Hello")]


# --- completions --------------------------------------------------------------------------


def test_completion_greedy_matches_offline_generate(client, model, tokenizer):
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=0, max_tokens=12)
    expected = offline(model, tokenizer, PROMPT, temperature=0, max_tokens=12)
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == expected.prompt_tokens
    assert reply.usage.completion_tokens == 12


def test_penalties_and_cuts_reach_the_sampler(client, model, tokenizer):
    fields = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    fields.update(top_k=5, top_p=0.9, min_p=0.05)
    reply = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        temperature=0,
        max_tokens=24,
        presence_penalty=fields["presence_penalty"],
        frequency_penalty=fields["frequency_penalty"],
        top_p=fields["top_p"],
        extra_body={k: fields[k] for k in ("repetition_penalty", "top_k", "min_p")},
    )
    expected = offline(model, tokenizer, PROMPT, temperature=0, max_tokens=24, **fields)
    plain = offline(model, tokenizer, PROMPT, temperature=0, max_tokens=24)
    assert reply.choices[0].text == expected.text != plain.text


def test_max_completion_tokens_wins_over_max_tokens(client):
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        temperature=0,
        max_tokens=50,
        max_completion_tokens=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert reply.usage.completion_tokens == 2
    assert reply.choices[0].finish_reason == "length"


def test_completion_without_max_tokens_stops_at_sixteen_as_openai(client):
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPT)
    assert reply.usage.completion_tokens == 16
    assert reply.choices[0].finish_reason == "length"


def test_completion_of_token_ids_and_of_a_batch_of_prompts(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, temperature=0, max_tokens=6)
    batch = client.completions.create(
        model=MODEL_NAME, prompt=["Hello", PROMPT], temperature=0, max_tokens=6
    )
    by_text = client.completions.create(
        model=MODEL_NAME, prompt="Hello", temperature=0, max_tokens=6
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.choices[1].text == by_ids.choices[0].text


def test_stop_string_cuts_the_text(client, model, tokenizer):
    prompt = "Why?\n"  # ends in "\n": the planted thinking reply follows
    reply = client.completions.create(
        model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=20, stop=[" answer"]
    )
    expected = offline(model, tokenizer, prompt, temperature=0, max_tokens=20, stop=(" answer",))
    assert reply.choices[0].text == expected.text == "<think>The"
    assert reply.choices[0].finish_reason == "stop"


def test_seed_reproduces_a_sample_and_another_seed_does_not(client):
    def sample(seed):
        body = dict(model=MODEL_NAME, prompt=PROMPT, temperature=1.0, max_tokens=16, seed=seed)
        return client.completions.create(**body).choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_completion_logprobs_lists_tokens_offsets_and_alternatives(client, tokenizer):
    # The planted reply: tokens that decode to distinct, whole characters.
    reply = client.completions.create(
        model=MODEL_NAME, prompt="Why?\n", temperature=0, max_tokens=6, logprobs=2
    )
    choice = reply.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert all(len(alternatives) <= 2 for alternatives in logprobs.top_logprobs)
    # Greedy: the chosen token is the most likely alternative.
    for token, value, alternatives in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert max(alternatives.values()) == pytest.approx(value)
        assert alternatives.get(token) == pytest.approx(value)
    offsets = [0] + [sum(map(len, logprobs.tokens[: i + 1])) for i in range(5)]
    assert logprobs.text_offset == offsets


def test_logprobs_of_tokens_a_grammar_forbids_are_finite_json(client, http):
    """Under a grammar most alternatives have logprob -inf, which JSON cannot spell: they
    go out as -9999.0 (as vLLM sends them), whole and streamed, never as a 500."""
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "logprobs": 5}
    reply = client.completions.create(**body, extra_body={"guided_choice": ["up", "down"]})
    values = [v for top in reply.choices[0].logprobs.top_logprobs for v in top.values()]
    assert -9999.0 in values and all(v >= -9999.0 for v in values)
    chat = {"model": MODEL_NAME, "messages": USER, "max_tokens": 2, "logprobs": True}
    chat |= {"top_logprobs": 5, "guided_choice": ["up", "down"], **NO_THINKING}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    events = stream_events(http, "/v1/chat/completions", chat)
    assert "-9999.0" in "".join(events) and "Infinity" not in "".join(events)


def test_usage_reports_cached_prompt_tokens_on_a_repeated_prompt(client):
    prompt = " ".join(["The weather in Paris is sunny"] * 8)  # several KV blocks
    body = dict(model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=2)
    first = client.completions.create(**body).usage
    second = client.completions.create(**body).usage
    assert first.prompt_tokens_details.cached_tokens == 0
    assert 0 < second.prompt_tokens_details.cached_tokens < second.prompt_tokens


def test_n_samples_differ_and_the_first_is_the_seeded_single_sample(client):
    body = dict(model=MODEL_NAME, prompt=PROMPT, temperature=1.0, max_tokens=8, seed=3)
    reply = client.completions.create(n=3, **body)
    single = client.completions.create(**body)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.text for c in reply.choices}) == 3
    assert reply.choices[0].text == single.choices[0].text
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens  # one prompt, counted once
    assert reply.usage.completion_tokens == 3 * 8


# --- streaming ----------------------------------------------------------------------------


def test_streamed_completion_equals_the_non_streamed_one(client):
    body = dict(model=MODEL_NAME, prompt=PROMPT, temperature=1.0, max_tokens=24, seed=11)
    whole = client.completions.create(**body)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **body)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_streamed_chat_sends_role_reasoning_and_content_deltas(client):
    body = dict(
        model=MODEL_NAME,
        messages=USER,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    whole = client.chat.completions.create(**body).choices[0].message
    chunks = list(client.chat.completions.create(stream=True, **body))
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant"
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (
        whole.reasoning_content
    )
    assert "".join(d.content or "" for d in deltas) == whole.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_streamed_logprobs_equal_the_non_streamed_ones(client):
    body = dict(model=MODEL_NAME, messages=USER, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**body).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(stream=True, **body))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]


def test_sse_framing_parses_with_a_plain_parser(http):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    events = stream_events(http, "/v1/completions", body)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    whole = http.post("/v1/completions", json=body).json()
    assert streamed_text(events) == whole["choices"][0]["text"]


def test_sixteen_concurrent_streams_all_complete_with_their_own_text(server, client, http):
    def body(i):
        return dict(model=MODEL_NAME, prompt=f"Hello {i}", temperature=1.0, max_tokens=20, seed=i)

    def stream(i):
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **body(i)))

    with ThreadPoolExecutor(16) as pool:
        streamed = list(pool.map(stream, range(16)))
    one_by_one = [client.completions.create(**body(i)).choices[0].text for i in range(16)]
    assert streamed == one_by_one
    assert len(set(streamed)) == 16
    assert wait_until_idle(http)["qinfer_kv_blocks_used"] == 0


def test_client_leaving_mid_stream_aborts_and_frees_its_blocks(server, http):
    before = server.engine.stats().requests_aborted_total
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 400, "stream": True}
    with httpx.Client(timeout=60) as leaving:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with leaving.stream(
            "POST", f"{server.url}/v1/completions", json=body, headers=headers
        ) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        # Leaving the `with` closes the connection mid-stream.
    values = wait_until_idle(http)
    assert values["qinfer_kv_blocks_used"] == 0
    assert server.engine.stats().requests_aborted_total == before + 1


def test_client_leaving_before_its_json_answer_aborts_it(server, http):
    before = server.engine.stats().requests_aborted_total
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 400}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        # 50 ms: a fraction of the time 400 tokens take, however fast the machine
        httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=0.05)
    assert wait_until_idle(http)["qinfer_kv_blocks_used"] == 0
    assert server.engine.stats().requests_aborted_total == before + 1


# --- metrics ------------------------------------------------------------------------------


def test_metrics_count_requests_tokens_and_latencies(client, http):
    before = metric_values(http)
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0)
    after = wait_until_idle(http)
    assert after["qinfer_generation_tokens_total"] == before["qinfer_generation_tokens_total"] + 5
    assert after["qinfer_time_to_first_token_seconds_count"] == (
        before["qinfer_time_to_first_token_seconds_count"] + 1
    )
    assert after["qinfer_inter_token_latency_seconds_count"] == (
        before["qinfer_inter_token_latency_seconds_count"] + 4
    )
    assert after["qinfer_kv_cache_usage_ratio"] == 0
    assert 0 <= after["qinfer_prefix_cache_hit_rate"] <= 1
    families = {f.name for f in text_string_to_metric_families(http.get("/metrics").text)}
    assert {"qinfer_http_requests", "qinfer_request_latency_seconds"} <= families


# --- the command line ---------------------------------------------------------------------


def test_qinfer_serve_command_serves_a_checkpoint(checkpoint, model, tokenizer, serve):
    url = serve(
        *("--model", str(checkpoint), "--api-key", API_KEY, "--served-model-name", MODEL_NAME),
        *("--num-kv-blocks", "32", "--chat-template-kwargs", '{"enable_thinking": false}'),
    ).url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=USER, temperature=0)
    expected = offline(model, tokenizer, USER, chat=True, temperature=0, enable_thinking=False)
    assert reply.choices[0].message.content == expected.text


def test_qinfer_serve_refuses_template_kwargs_that_are_not_an_object(capsys):
    assert main(["serve", "--chat-template-kwargs", "[1]"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("qinfer: error:") and "JSON object" in error and "\n" not in error


# --- structured outputs ------------------------------------------------------------------

REPLY_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 8},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["answer", "score"],
}


def follows_reply_schema(text: str) -> bool:
    import jsonschema

    try:
        value = json.loads(text)
        jsonschema.validate(value, REPLY_SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return set(value) <= set(REPLY_SCHEMA["properties"])


#: The grammar starts after a thinking model's </think>; these tests check the answer itself.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def test_response_format_json_schema_with_the_openai_client(client):
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        temperature=1.0,
        seed=0,
        n=4,
        max_tokens=200,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "reply", "schema": REPLY_SCHEMA, "strict": True},
        },
        extra_body=NO_THINKING,  # a thinking answer's JSON comes after </think>: not tested here
    )
    assert all(c.finish_reason == "stop" for c in reply.choices)
    assert all(follows_reply_schema(c.message.content) for c in reply.choices)
    free = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=20)
    assert not follows_reply_schema(free.choices[0].message.content)


def test_response_format_streams_the_same_json(client):
    body = dict(
        model=MODEL_NAME,
        messages=USER,
        temperature=1.0,
        seed=3,
        max_tokens=200,
        response_format={"type": "json_object"},
        extra_body=NO_THINKING,
    )
    whole = client.chat.completions.create(**body).choices[0].message.content
    stream = client.chat.completions.create(**body, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole and isinstance(json.loads(whole), dict)


def test_vllm_guided_fields_in_extra_body(client):
    regex = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=20,
        extra_body={"guided_regex": "[a-z]{3}-[0-9]", **NO_THINKING},
    )
    assert re.fullmatch("[a-z]{3}-[0-9]", regex.choices[0].message.content)
    choice = client.completions.create(
        model=MODEL_NAME, prompt="Hi", max_tokens=8, extra_body={"guided_choice": ["up", "down"]}
    )
    assert choice.choices[0].text in ("up", "down")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"guided_json": {"type": "nope"}}, "json_schema is invalid"),
        ({"guided_regex": "[a-"}, "regex is invalid"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one of"),
        ({"response_format": {"type": "json_schema"}}, "json_schema is required"),
    ],
)
def test_a_bad_constraint_is_a_400_and_the_server_keeps_serving(client, extra, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(
            model=MODEL_NAME, messages=USER, max_tokens=4, extra_body=extra
        )
    assert client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2).choices

"""Prompt logprobs: `SamplingParams.prompt_logprobs` through the engine, and
`/v1/completions` with `echo` + `logprobs` (and `max_tokens: 0`, lm-eval's loglikelihood).

Every logprob is checked against the log-softmax of transformers' fp32 logits at each
prompt position, with chunked prefill (8 tokens a step), batched with decoding requests,
after the prompt's blocks were cached (such a request does not look up the prefix cache),
and after a preemption; then through the real `openai` client as lm-eval sends it.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from checkpoints import build_checkpoint
from servers import serving
from text_assets import CHATML_SPECIAL, QWEN3_ADDED, save_qwen3_tokenizer, train_tokenizer

from qinfer import LLM
from qinfer.engine.run import run_requests
from qinfer.request.sampling import SamplingParams

MODEL = "tiny-logprobs"
TEXTS = [
    "The quick brown fox jumps over the lazy dog, and the dog sleeps on.",
    "Hello world",
    "Once upon a time there was a small model that scored its own prompts.",
]
BLOCK = 4
TOP = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("logprobs")
    backend = train_tokenizer(CHATML_SPECIAL, QWEN3_ADDED)
    save_qwen3_tokenizer(folder, backend)
    build_checkpoint(folder, "qwen3", vocab_size=backend.get_vocab_size())
    return folder


def make_llm(checkpoint, **engine_args) -> LLM:
    # 8 tokens a step: every prompt is prefilled in several chunks.
    args = dict(max_num_seqs=4, max_num_batched_tokens=8, block_size=BLOCK) | engine_args
    return LLM(str(checkpoint), dtype="float32", device="cpu", **args)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return make_llm(checkpoint)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def reference(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax (L, V) of one prompt's fp32 logits."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_prompt_logprobs(entries, ids: list[int], hf_model) -> None:
    """entries[0] is None; entries[p] holds log P(ids[p] | ids[:p]) and the TOP likeliest,
    each within 1e-4 of transformers'."""
    expected = reference(hf_model, ids)
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        entry, row = entries[p], expected[p - 1]
        assert entry.token_id == ids[p]
        assert entry.logprob == pytest.approx(row[ids[p]].item(), abs=1e-4)
        values, top_ids = torch.topk(row, TOP)
        assert list(entry.top_logprobs) == top_ids.tolist()
        got = torch.tensor(list(entry.top_logprobs.values()))
        torch.testing.assert_close(got, values, atol=1e-4, rtol=0)


def encode(llm: LLM, text: str) -> list[int]:
    return llm.engine.tokenizer.encode(text)


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_prompt_logprobs_match_transformers_in_chunks(llm, hf_model, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, prompt_logprobs=TOP)
    ids = [encode(llm, text) for text in TEXTS]
    outputs = llm.generate(ids, params, use_tqdm=False)
    for output, prompt in zip(outputs, ids, strict=True):
        assert_prompt_logprobs(output.prompt_logprobs, prompt, hf_model)
        assert output.num_generated_tokens == max_tokens
        assert output.finish_reason == "length"
    # The same request without prompt logprobs generates the same tokens.
    plain = llm.generate(ids, params.replace(prompt_logprobs=None), use_tqdm=False)
    assert [o.token_ids for o in plain] == [o.token_ids for o in outputs]
    assert all(o.prompt_logprobs is None for o in plain)


def test_prompt_logprobs_skip_the_prefix_cache(llm, hf_model):
    ids = encode(llm, TEXTS[2])
    llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)  # caches its blocks
    (cached,) = llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)
    assert cached.num_cached_tokens >= BLOCK  # a plain request starts from them
    (output,) = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=TOP), False)
    assert output.num_cached_tokens == 0
    assert_prompt_logprobs(output.prompt_logprobs, ids, hf_model)


def test_prompt_logprobs_batched_with_decoding_and_after_preemption(checkpoint, hf_model):
    # 16 blocks of 4 tokens: the decoding requests and the prompts do not all fit, so the
    # newest running sequences are preempted and computed again later.
    small = make_llm(checkpoint, num_kv_blocks=16, enable_prefix_caching=False)
    decode = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    scored = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    prompts = [(encode(small, "Hello there"), decode)] + [
        (encode(small, text), scored) for text in TEXTS
    ]
    requests = [small.engine.make_request(p, params) for p, params in prompts]
    finished = {o.request_id: o for o in run_requests(small.engine, requests) if o.finished}
    assert small.engine.stats().preemptions_total > 0
    for request, (ids, _) in zip(requests[1:], prompts[1:], strict=True):
        assert_prompt_logprobs(finished[request.seq.request_id].prompt_logprobs, ids, hf_model)


# -- the server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(checkpoint):
    with serving(
        *("--model", str(checkpoint), "--served-model-name", MODEL, "--dtype", "float32"),
        *("--device", "cpu", "--block-size", str(BLOCK), "--max-num-batched-tokens", "64"),
    ) as server:
        yield server.url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def test_lm_eval_loglikelihood_request_through_the_openai_client(client, llm, hf_model):
    """lm-eval's local-completions loglikelihood: context + continuation as one prompt,
    max_tokens 0, echo, logprobs 1; it sums token_logprobs over the continuation's tokens
    and checks each is the top_logprobs' likeliest (is_greedy)."""
    response = client.completions.create(
        model=MODEL, prompt=TEXTS, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    assert response.usage.completion_tokens == 0
    for choice, text in zip(response.choices, TEXTS, strict=True):
        ids = encode(llm, text)
        expected = reference(hf_model, ids)
        assert choice.text == text and choice.finish_reason == "length"
        logprobs = choice.logprobs
        assert logprobs.tokens == [llm.engine.tokenizer.decode([t]) for t in ids]
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        got = torch.tensor(logprobs.token_logprobs[1:])
        want = torch.stack([expected[p - 1, ids[p]] for p in range(1, len(ids))])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        for p in range(1, len(ids)):
            ((token, value),) = logprobs.top_logprobs[p].items()
            best = expected[p - 1].argmax().item()
            assert token == llm.engine.tokenizer.decode([best])
            assert value == pytest.approx(expected[p - 1, best].item(), abs=1e-4)
        assert logprobs.text_offset[0] == 0
        offsets = [len("".join(logprobs.tokens[:i])) for i in range(len(ids))]
        assert logprobs.text_offset == offsets


def test_echo_logprobs_then_the_generated_tokens_streamed_equal_whole(client, server, llm):
    fields = dict(model=MODEL, prompt=TEXTS[1], max_tokens=3, echo=True, logprobs=2)
    whole = client.completions.create(temperature=0, **fields).choices[0]
    ids = encode(llm, TEXTS[1])
    (generated,) = llm.generate(
        [ids], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2), use_tqdm=False
    )
    assert whole.text == TEXTS[1] + generated.text
    assert len(whole.logprobs.tokens) == len(ids) + 3
    expected = [None] + [e.logprob for e in generated.prompt_logprobs[1:]]
    assert whole.logprobs.token_logprobs[: len(ids)] == pytest.approx(expected, abs=1e-5)
    chunks = list(client.completions.create(temperature=0, stream=True, **fields))
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.tokens]
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert streamed == whole.logprobs.tokens


def test_max_tokens_zero_without_echo_is_an_empty_completion(server):
    body = {"model": MODEL, "prompt": TEXTS[1], "max_tokens": 0}
    answer = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    assert answer["choices"][0]["text"] == "" and answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 0

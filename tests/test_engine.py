"""The batching engine against a reference that shares none of its machinery: each prompt
run alone through the model's own call over its contiguous caches (the seed's
`update_and_fetch` + grouped SDPA: `qinfer.attention.reference`), one token a step, with
no scheduler, KV blocks or paged attention; its tokens chosen by the request's own
sampling settings and generator.

Every test runs on a tiny random Qwen3 checkpoint in float32 and checks that the engine
leaves its KV pool clean: after each test no block is held by a sequence.
"""

import argparse
import random

import pytest
import torch
from checkpoints import CHAT_VOCAB_SIZE, GEMMA3, random_model, use_features

import qinfer
from qinfer.core.errors import QinferError, RequestError
from qinfer.engine import LLM, block_manager
from qinfer.request.sampling import SamplingParams, make_generator, sample

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)

#: The engine's attention backends (`qinfer.attention.backend`), each held to the
#: reference's tokens.
BACKENDS = ["paged", "gathered"]


@pytest.fixture(scope="module")
def model(qwen3_chat_folder):
    return qinfer.load_model(qwen3_chat_folder, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def tokenizer(qwen3_chat_folder):
    return qinfer.load_tokenizer(qwen3_chat_folder)


def make_llm(model, tokenizer=None, **engine_args) -> LLM:
    return LLM(model, tokenizer, **engine_args)


@pytest.fixture
def pools():
    """Every LLM a test makes; after the test, none may still hold a block."""
    made = []
    yield made
    for llm in made:
        stats = llm.engine.stats()
        assert stats.kv_blocks_used == 0, stats
        assert stats.num_running == stats.num_waiting == 0, stats


def alone(model, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """The reference: `params.max_tokens` tokens after the prompt (the tests here ignore
    EOS), the prompt prefilled whole and each token fed back alone, through the model's
    contiguous caches (`Transformer.make_cache`, the reference attention backend)."""
    assert params.ignore_eos and not params.stop and not params.stop_token_ids
    cache = model.make_cache()
    generator = make_generator(params, model.device)
    history = list(prompt_ids)
    logits = model(torch.tensor([history]), cache=cache, last_only=True)  # (1, 1, V)
    for _ in range(params.max_tokens):
        chosen = sample(logits[:, -1], [params], [history], [generator], [len(prompt_ids)])
        history.append(int(chosen.token_ids[0]))
        logits = model(torch.tensor([history[-1:]]), cache=cache)
    return history[len(prompt_ids) :]


def random_prompts(seed: int, count: int, longest: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(CHAT_VOCAB_SIZE) for _ in range(rng.randint(1, longest))]
        for _ in range(count)
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_batch_with_preemption_equals_each_request_alone(model, pools, backend):
    rng = random.Random(0)
    prompts = random_prompts(0, 32, longest=40)
    params = [GREEDY.replace(max_tokens=rng.randint(1, 16)) for _ in prompts]
    # Tiny blocks, few sequences, a small step budget (chunked prefill) and a pool that
    # cannot hold everyone: sequences are preempted and recomputed.
    llm = make_llm(
        model,
        block_size=4,
        max_num_seqs=6,
        max_num_batched_tokens=24,
        num_kv_blocks=30,
        attention_backend=backend,
    )
    pools.append(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().preemptions_total > 0
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        assert out.token_ids == alone(model, prompt, p), f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length" and out.num_generated_tokens == p.max_tokens


@pytest.mark.parametrize(
    "family, overrides",
    [("mistral", dict(sliding_window=6, head_dim=16)), ("gemma3", GEMMA3)],
    ids=["mistral", "gemma3"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_window_model_batched_equals_alone(pools, family, overrides, backend):
    # Gemma 3: two sliding layers and a global one, each with its own RoPE base.
    model = random_model(family, **overrides, vocab_size=CHAT_VOCAB_SIZE)
    prompts = random_prompts(1, 8, longest=20)
    params = GREEDY.replace(max_tokens=10)
    llm = make_llm(
        model, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, attention_backend=backend
    )
    pools.append(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == alone(model, prompt, params)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_prefix_is_served_from_the_cache(model, pools, backend):
    prefix = list(range(30, 70))  # 40 shared tokens: 5 blocks of 8
    tails = random_prompts(3, 6, longest=6)
    params = GREEDY.replace(max_tokens=4)
    llm = make_llm(model, block_size=8, max_num_seqs=4, attention_backend=backend)
    pools.append(llm)
    first = llm.generate([prefix + tails[0]], params, use_tqdm=False)
    computed_before = llm.engine.stats().prompt_tokens_computed_total
    second = llm.generate([prefix + t for t in tails[1:]], params, use_tqdm=False)
    computed = llm.engine.stats().prompt_tokens_computed_total - computed_before
    assert first[0].num_cached_tokens == 0
    assert all(out.num_cached_tokens == 40 for out in second)
    assert computed == sum(len(t) for t in tails[1:])  # only the tails ran
    for tail, out in zip(tails[1:], second, strict=True):
        assert out.token_ids == alone(model, prefix + tail, params)


def test_hash_collisions_never_leak_another_prompts_kv(model, pools, monkeypatch):
    monkeypatch.setattr(block_manager, "block_hash", lambda parent, tokens: 7)
    prompts = random_prompts(4, 6, longest=24)
    prompts += [p[:8] + [1, 2, 3] for p in prompts[:3]]  # share a first block, then differ
    params = GREEDY.replace(max_tokens=5)
    llm = make_llm(model, block_size=4, max_num_seqs=3)
    pools.append(llm)
    llm.generate(prompts, params, use_tqdm=False)
    outputs = llm.generate(prompts, params, use_tqdm=False)  # every lookup collides now
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == alone(model, prompt, params)


def test_seeded_sampling_matches_the_reference_per_request(model, pools):
    prompts = random_prompts(5, 4, longest=12)
    params = [
        SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.2, top_p=0.9, seed=12, max_tokens=6, ignore_eos=True),
        GREEDY.replace(max_tokens=7),
        SamplingParams(temperature=1.0, min_p=0.05, seed=13, max_tokens=5, ignore_eos=True),
    ]
    llm = make_llm(model, block_size=4, max_num_seqs=4)
    pools.append(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        assert out.token_ids == alone(model, prompt, p)


def test_text_stop_strings_and_eos_agree_with_generate(model, tokenizer, pools):
    prompts = ["hello there", "abc", [{"role": "user", "content": "hi"}]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=12, stop=["e", "a"]),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[100]),
    ]
    llm = make_llm(model, tokenizer, block_size=4)
    pools.append(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        want = qinfer.generate(model, tokenizer, prompt, p)
        assert out.text == want.text
        assert out.token_ids == want.token_ids
        assert out.finish_reason == ("stop" if want.finish_reason == "eos" else want.finish_reason)


def test_logprobs_are_reported_for_every_token(model, pools):
    llm = make_llm(model)
    pools.append(llm)
    (out,) = llm.generate([[5, 6, 7]], GREEDY.replace(max_tokens=4, logprobs=3), use_tqdm=False)
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    for lp in out.logprobs:
        assert len(lp.top_logprobs) == 3 and lp.logprob == max(lp.top_logprobs.values())


def test_bad_requests_are_refused_and_the_engine_keeps_serving(model, tokenizer, pools):
    llm = make_llm(model, tokenizer, num_kv_blocks=4, block_size=4)
    pools.append(llm)
    with pytest.raises(RequestError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(RequestError, match="KV pool"):
        llm.generate([list(range(17))], use_tqdm=False)  # 4 blocks x 4 tokens + 1
    with pytest.raises(RequestError, match="vocabulary"):
        llm.generate([[1, CHAT_VOCAB_SIZE]], use_tqdm=False)
    with pytest.raises(QinferError, match="max_tokens"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=-1), use_tqdm=False)
    with pytest.raises(QinferError, match="stop strings"):
        llm.generate([[1, 2]], SamplingParams(stop=[str(i) for i in range(17)]), use_tqdm=False)
    (out,) = llm.generate([[1, 2, 3]], GREEDY.replace(max_tokens=3), use_tqdm=False)
    assert out.token_ids == alone(model, [1, 2, 3], GREEDY.replace(max_tokens=3))


def test_prompt_longer_than_the_context_is_refused(model, pools):
    llm = make_llm(model, max_model_len=16)
    pools.append(llm)
    with pytest.raises(RequestError, match="context 16"):
        llm.generate([list(range(16))], use_tqdm=False)


def test_sequence_stops_when_the_pool_is_full(model, pools):
    llm = make_llm(model, num_kv_blocks=2, block_size=4)  # 8 positions in all
    pools.append(llm)
    (out,) = llm.generate([[1, 2, 3]], GREEDY.replace(max_tokens=50), use_tqdm=False)
    assert out.finish_reason == "length" and out.num_generated_tokens == 6  # 3 + 6 - 1 = 8


def test_abort_mid_generation_frees_the_blocks_and_others_continue(model, pools):
    llm = make_llm(model, block_size=4)
    pools.append(llm)
    engine = llm.engine
    engine.add_request([1, 2, 3, 4, 5], GREEDY.replace(max_tokens=20), request_id="victim")
    engine.add_request([6, 7, 8], GREEDY.replace(max_tokens=6), request_id="other")
    for _ in range(3):
        engine.step()
    aborted = engine.abort("victim")
    assert aborted.finished and aborted.finish_reason == "abort"
    assert engine.abort("victim") is None  # unknown now: ignored
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].request_id == "other"
    assert outputs[-1].token_ids == alone(model, [6, 7, 8], GREEDY.replace(max_tokens=6))
    assert engine.stats().requests_aborted_total == 1


def test_stats_count_requests_tokens_and_cache(model, pools):
    llm = make_llm(model, block_size=4)
    pools.append(llm)
    llm.generate([[1, 2, 3, 4, 5, 6]] * 2, GREEDY.replace(max_tokens=3), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.requests_finished_total == 2
    assert stats.generation_tokens_total == 6
    assert stats.prompt_tokens_total == 12
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.kv_blocks_cached >= 1


def test_llm_loads_the_model_and_its_tokenizer_from_a_folder(
    qwen3_chat_folder, model, tokenizer, pools
):
    llm = LLM(qwen3_chat_folder, dtype="float32", device="cpu", block_size=4)
    pools.append(llm)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    (out,) = llm.generate("hello", params, use_tqdm=False)
    assert out.text == qinfer.generate(model, tokenizer, "hello", params).text


def test_engine_arguments_are_checked_by_name(model):
    with pytest.raises(QinferError, match="unknown engine argument 'max_seqs'"):
        LLM(model, max_seqs=4)
    with pytest.raises(QinferError, match="block_size"):
        LLM(model, block_size=0)
    with pytest.raises(QinferError, match="holds no block"):
        LLM(model, kv_cache_memory=10)
    with pytest.raises(QinferError, match="unknown attention_backend 'flash'; use one of auto"):
        LLM(model, attention_backend="flash")


def test_only_the_paged_backend_is_batch_invariant():
    invariant = random_model("qwen3")
    use_features(invariant, qinfer.Features(batch_invariant=True))
    with pytest.raises(QinferError, match="'gathered' has no batch-invariant arithmetic"):
        LLM(invariant, attention_backend="gathered")


def test_exact_is_chosen_when_a_model_loads():
    """`exact` picks the quantized Linears' paths at load: asked of a loaded model with the
    other one, it is refused in one line; the flag and `LLM`'s keyword reach the load."""
    from qinfer.engine.args import add_model_arguments, load_config

    with pytest.raises(QinferError, match="exact True is chosen when a model loads"):
        LLM(random_model("qwen3"), exact=True)
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    assert load_config(parser.parse_args(["--exact"])).model_arguments()["exact"] is True
    assert "exact" not in load_config(parser.parse_args([])).model_arguments()


def test_block_accounting_holds_through_random_adds_aborts_and_preemptions(model, pools):
    """After every step each block's reference count equals the tables that hold it, free
    blocks are exactly those nobody holds, and waiting sequences hold nothing."""
    from collections import Counter

    llm = make_llm(model, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=8)
    pools.append(llm)
    engine, rng = llm.engine, random.Random(7)
    shared = list(range(100, 112))  # three full blocks many prompts start with
    live: list[str] = []
    for step in range(120):
        if rng.random() < 0.4:
            tail = random_prompts(step, 1, longest=10)[0]
            live.append(
                engine.add_request(shared + tail, GREEDY.replace(max_tokens=rng.randint(1, 16)))
            )
        if live and rng.random() < 0.1:
            engine.abort(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        (pool,) = engine.block_manager.pools
        held = Counter(b for seq in engine.scheduler.running for b in seq.tables[0])
        for block in pool.blocks:
            assert block.ref_count == held[block.block_id]
            assert (block.ref_count == 0) == (block.block_id in pool.free_blocks)
        assert all(not seq.tables[0] for seq in engine.scheduler.waiting)
    for request_id in live:
        engine.abort(request_id)
    assert engine.stats().preemptions_total > 0 and engine.stats().prefix_cache_hits > 0

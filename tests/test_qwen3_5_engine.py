"""Hybrid models (Qwen3.5 dense and MoE: Gated DeltaNet + gated attention) through the
engine's paged path, in float32: a state slot per running sequence beside the KV blocks.

- greedy tokens through `LLM` with small blocks and chunked prefill equal transformers'
  greedy `generate`, token for token;
- a request's tokens are the same alone and batched with prompts of other lengths, with
  its prompt in one chunk or in several (its state carried across chunks), and when a
  tiny pool preempts it (its state recomputed from its first token);
- abort and finish give the slot back; the slots bound the running sequences; a budget
  that holds no sequence's state, one too small for the snapshots asked for, and a hybrid
  draft model, are one-line errors;
- speculative decoding (n-gram, a draft model) gives the tokens of none: a verification
  that rejects a proposal sets the state back to its checkpoint; also beside prefix-cache
  hits and preemption;
- the prefix cache keeps state snapshots: a second wave of prompts sharing a 96-token
  prefix with the first starts from the snapshot there (the cached tokens reported are the
  tokens skipped), with preemption too, and every token equals a run without the cache and
  transformers'; a prompt that diverges from a cached one where no snapshot is leaves one
  there for the next; a tight snapshot budget gives fewer hits, the same tokens.
"""

import pytest
import torch
from checkpoints import HYBRID, build_checkpoint, random_model, random_tokens

import qinfer
from qinfer.attention.deltanet import CHUNK_SIZE
from qinfer.attention.state_pool import StatePool
from qinfer.core.errors import QinferError
from qinfer.engine import LLM
from qinfer.request.sampling import SamplingParams
from qinfer.runtime.step import ScheduledStep
from qinfer.runtime.step_channel import pack, unpack

pytestmark = pytest.mark.slow

FAMILIES = ["qwen3_5", "qwen3_5_moe"]
NEW_TOKENS = 8
#: prompt lengths: a decode-sized one, one past a block, one past the DeltaNet's chunk
LENGTHS = [3, 21, CHUNK_SIZE + 7]
#: small blocks, steps of 16 tokens (every prompt but the first in several chunks)
SMALL = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def prompts(lengths: list[int], seed: int = 3) -> list[list[int]]:
    return [random_tokens(1, n, seed=seed + i)[0].tolist() for i, n in enumerate(lengths)]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(transformers model, qinfer model) of one random checkpoint, float32 on CPU."""
    folder = tmp_path_factory.mktemp(request.param)
    reference = build_checkpoint(folder, request.param, **HYBRID[request.param])
    return reference, qinfer.load_model(folder, dtype=torch.float32, device="cpu")


def generate(model, ids: list[list[int]], **engine_args) -> list[list[int]]:
    llm = LLM(model, **{**SMALL, **engine_args})
    return [out.token_ids for out in llm.generate(ids, GREEDY, use_tqdm=False)]


def test_greedy_tokens_equal_transformers_generate(pair):
    """Three prompts batched, prefilled in chunks of 16 over blocks of 4: each one's greedy
    tokens are transformers' greedy generate of that prompt alone."""
    reference, model = pair
    reference.generation_config.eos_token_id = None  # as ignore_eos
    ids = prompts(LENGTHS)
    ours = generate(model, ids)
    for prompt, tokens in zip(ids, ours, strict=True):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False
            )
        assert tokens == out[0, len(prompt) :].tolist()


def test_batched_and_chunked_equal_alone_and_whole(pair):
    """Each prompt alone in steps that hold it whole gives the tokens it gets batched with
    the others and prefilled in chunks of 16 (then 5: a chunk shorter than a block)."""
    _, model = pair
    ids = prompts(LENGTHS)
    whole = [generate(model, [prompt], max_num_batched_tokens=128)[0] for prompt in ids]
    assert generate(model, ids) == whole
    assert generate(model, ids, max_num_batched_tokens=5) == whole


def test_preemption_recomputes_the_state(pair):
    """A pool of 14 blocks of 4 for four prompts that need 12 at once: sequences are
    preempted (their slots freed, their states recomputed from the first token when they
    resume) and every one still gets its tokens alone."""
    _, model = pair
    ids = prompts([17, 13, 9, 20], seed=11)
    alone = [generate(model, [prompt])[0] for prompt in ids]
    llm = LLM(model, **SMALL, num_kv_blocks=14)
    outs = llm.generate(ids, GREEDY, use_tqdm=False)
    assert llm.engine.stats().preemptions_total > 0
    assert [out.token_ids for out in outs] == alone
    manager = llm.engine.block_manager
    assert manager.num_free_state_slots == manager.state_slots == SMALL["max_num_seqs"]


def test_abort_frees_the_slot():
    """A request aborted mid-prompt gives its slot back; the next one starts from a zero
    state in it and gets its tokens alone."""
    model = random_model("qwen3_5", **HYBRID["qwen3_5"])
    llm = LLM(model, **{**SMALL, "max_num_seqs": 1})
    engine = llm.engine
    first, second = prompts([40, 9])
    request_id = engine.add_request(first, GREEDY)
    engine.step()  # the first chunk of 16: its state holds them
    assert engine.block_manager.num_free_state_slots == 0
    assert engine.abort(request_id).finish_reason == "abort"
    assert engine.block_manager.num_free_state_slots == 1
    assert [out.token_ids for out in llm.generate([second], GREEDY, use_tqdm=False)] == [
        generate(model, [second])[0]
    ]


def test_state_slots_bound_the_running_sequences():
    """A budget whose half holds two sequences' states: two slots, so at most two
    sequences run at once (max_num_seqs 4), the KV blocks get the rest of the budget, and
    the tokens are those of four slots."""
    model = random_model("qwen3_5", **HYBRID["qwen3_5"])
    per_slot = StatePool.bytes_per_slot(model.config, model.dtype)
    llm = LLM(model, **SMALL, kv_cache_memory=5 * per_slot)
    engine = llm.engine
    assert engine.executor.state_slots == 2
    assert engine.executor.kv_cache_bytes <= 5 * per_slot
    ids = prompts([5, 6, 7, 8])  # at most 16 tokens: 4 blocks each
    request_ids = [engine.add_request(prompt, GREEDY) for prompt in ids]
    outs, most = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out.token_ids
        most = max(most, len(engine.scheduler.running))
    assert most == 2
    assert [outs[request_id] for request_id in request_ids] == generate(model, ids)


def test_the_kv_pool_holds_only_the_attention_layers():
    """Half the layers are linear attention: the KV pool holds the other half, and a
    budget buys twice the blocks it would for K/V in every layer."""
    model = random_model("qwen3_5", **HYBRID["qwen3_5"])
    engine = LLM(model, **SMALL, num_kv_blocks=8).engine
    (pool,) = engine.executor.runner.pools
    assert pool.keys.shape[0] == 2 == model.config.num_hidden_layers // 2


def test_a_budget_without_room_for_one_state_is_one_error():
    model = random_model("qwen3_5", **HYBRID["qwen3_5"])
    per_slot = StatePool.bytes_per_slot(model.config, model.dtype)
    with pytest.raises(QinferError, match="kv_cache_memory of .* holds no sequence's recurrent"):
        LLM(model, kv_cache_memory=per_slot)


def speculated(model, ids, speculative) -> tuple[list[list[int]], list[tuple[int, int]], LLM]:
    """Greedy tokens of `ids` with speculative decoding, the (proposed, accepted) count of
    every verification, and the engine."""
    llm = LLM(model, **SMALL, num_kv_blocks=96, speculative=speculative)
    counted = llm.engine.speculator.verified
    verifications = []

    def verified(seq, proposed, accepted):
        verifications.append((proposed, accepted))
        counted(seq, proposed, accepted)

    llm.engine.speculator.verified = verified
    outs = llm.generate(ids, LONG, use_tqdm=False)
    return [out.token_ids for out in outs], verifications, llm


#: long enough for the random model's greedy text to repeat itself (n-gram proposals hit)
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def test_speculative_decoding_gives_the_tokens_of_none():
    """n-gram proposals, some verifications keeping all, some part, some none of them (the
    state set back to before the proposals, the kept ones run again), and a draft model's
    (a Qwen3 of the same vocabulary): every token is the engine's without speculation. The
    state pool holds a checkpoint row per slot."""
    model = random_model("qwen3_5", **HYBRID["qwen3_5"])
    ids = [[5, 6, 7, 8] * 7] + prompts([9, 40])
    llm = LLM(model, **SMALL, num_kv_blocks=96)
    alone = [out.token_ids for out in llm.generate(ids, LONG, use_tqdm=False)]
    tokens, verifications, llm = speculated(
        model, ids, {"method": "ngram", "num_speculative_tokens": 3}
    )
    assert tokens == alone
    assert any(0 < kept < proposed for proposed, kept in verifications)  # run again
    assert any(0 == kept < proposed for proposed, kept in verifications)  # set back only
    assert any(kept == proposed for proposed, kept in verifications)  # kept as it ran
    states = llm.engine.executor.runner.states
    per_slot = StatePool.bytes_per_slot(model.config, model.dtype)
    assert states.nbytes == (2 * states.slots + states.snapshots) * per_slot
    draft = {"method": "draft", "model": random_model("qwen3"), "num_speculative_tokens": 3}
    tokens, verifications, _ = speculated(model, ids, draft)
    assert tokens == alone and verifications


def test_speculation_beside_the_prefix_cache_and_preemption():
    """The waves with n-gram proposals over a pool of 16 blocks: hits, preemptions, kept
    proposals, and the tokens of the engine without either."""
    model = random_model("qwen3_5", **HYBRID["qwen3_5"])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain, none, _ = run_waves(model, params, enable_prefix_caching=False)
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    tokens, cached, llm = run_waves(model, params, num_kv_blocks=16, speculative=ngram)
    stats = llm.engine.stats()
    assert stats.preemptions_total > 0 and stats.spec_accepted_tokens_total > 0
    assert none == [0] * 8 and cached[2:] == [SHARED] * 6
    assert tokens == plain


def test_a_hybrid_draft_model_is_one_error():
    model = random_model("qwen3_5", **HYBRID["qwen3_5"])
    draft = {"method": "draft", "model": model, "num_speculative_tokens": 2}
    with pytest.raises(
        QinferError, match="speculative model: model_type .* keeps a recurrent state"
    ):
        LLM(model, speculative=draft)


#: the prefix-cache tests' engine: blocks of 16, chunks of 32, two sequences at a time
CACHED = dict(block_size=16, max_num_batched_tokens=32, max_num_seqs=2, num_kv_blocks=64)
SHARED = 96  # the prefix both waves share: six blocks


def waves() -> tuple[list[list[int]], list[list[int]]]:
    """Two waves of four prompts: the same 96 tokens, then each its own tail (the first
    wave's first prompt's last full block ends past 96, so no prompt's end is there)."""
    shared = random_tokens(1, SHARED, seed=5)[0].tolist()
    tails = [[25, 19, 30, 22], [21, 28, 17, 33]]
    return tuple(
        [shared + random_tokens(1, n, seed=seed + i)[0].tolist() for i, n in enumerate(lengths)]
        for seed, lengths in zip((20, 40), tails, strict=True)
    )


def run_waves(model, params=GREEDY, **engine_args) -> tuple[list[list[int]], list[int], LLM]:
    """Both waves through one engine, the second once the first finished: every prompt's
    greedy tokens, the prompt tokens each found cached, and the engine."""
    llm = LLM(model, **{**CACHED, **engine_args})
    outs = [out for wave in waves() for out in llm.generate(wave, params, use_tqdm=False)]
    return [out.token_ids for out in outs], [out.num_cached_tokens for out in outs], llm


def test_a_second_wave_starts_from_the_shared_prefix_state(pair):
    """A pool of 14 blocks preempts a sequence of the first wave; the second prompt of the
    first wave leaves a snapshot where it diverges from the first (96), the later ones
    start there: 96 tokens cached for each, and every prompt's tokens are those of the
    engine without the cache and transformers' greedy."""
    reference, model = pair
    tokens, cached, llm = run_waves(model, num_kv_blocks=14)
    assert llm.engine.stats().preemptions_total > 0
    assert cached == [0, 0] + [SHARED] * 6
    uncached, none, _ = run_waves(model, num_kv_blocks=14, enable_prefix_caching=False)
    assert none == [0] * 8
    assert tokens == uncached
    reference.generation_config.eos_token_id = None  # as ignore_eos
    for prompt, ours in zip([p for wave in waves() for p in wave], tokens, strict=True):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False
            )
        assert ours == out[0, len(prompt) :].tolist()


def test_the_cached_tokens_reported_are_the_tokens_skipped():
    """Without preemption, the prompt tokens the engine ran are the prompts' tokens less
    those reported cached."""
    model = random_model("qwen3_5", **HYBRID["qwen3_5"])
    _, cached, llm = run_waves(model)
    stats = llm.engine.stats()
    assert stats.preemptions_total == 0 and sum(cached) > 0
    assert stats.prompt_tokens_total - stats.prompt_tokens_computed_total == sum(cached)
    assert stats.prefix_cache_hits == sum(cached)


def test_a_prompt_diverging_from_a_cached_one_leaves_a_snapshot_there():
    """One prompt at a time: the first caches its blocks (and its state at its last full
    block, 112); the second finds the 96 shared tokens' blocks but no state there, so it
    recomputes them and snapshots the state at 96; the third starts from it."""
    model = random_model("qwen3_5", **HYBRID["qwen3_5"])
    first, _ = waves()
    llm = LLM(model, **{**CACHED, "max_num_seqs": 1, "state_snapshots": 8})
    cached = [llm.generate([p], GREEDY, use_tqdm=False)[0].num_cached_tokens for p in first]
    assert cached == [0, 0, SHARED, SHARED]
    manager = llm.engine.block_manager
    assert len(manager.snapshots) == 1 + 4  # 96, and each prompt's last full block
    manager.flush_prefix_cache()
    assert len(manager.snapshots) == 0
    assert llm.generate([first[2]], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_a_tight_snapshot_budget_gives_fewer_hits_and_the_same_tokens():
    """The waves, then the first prompt again. Sixteen rows keep its end's state (its last
    full block, 112); one row keeps only the state at 96 (shared by every prompt: a
    prompt's end never takes its row); no row finds nothing. The tokens are the same."""
    model = random_model("qwen3_5", **HYBRID["qwen3_5"])
    repeat = waves()[0][0]
    results = {}
    for rows in (16, 1, 0):
        tokens, cached, llm = run_waves(model, state_snapshots=rows)
        (out,) = llm.generate([repeat], GREEDY, use_tqdm=False)
        assert llm.engine.executor.state_snapshots == rows
        results[rows] = tokens + [out.token_ids], cached + [out.num_cached_tokens]
    assert results[16][1] == [0, 0] + [SHARED] * 6 + [112]
    assert results[1][1] == [0, 0] + [SHARED] * 6 + [SHARED]
    assert results[0][1] == [0] * 9
    assert results[16][0] == results[1][0] == results[0][0]


def test_snapshots_too_many_for_the_budget_is_one_error():
    model = random_model("qwen3_5", **HYBRID["qwen3_5"])
    per_slot = StatePool.bytes_per_slot(model.config, model.dtype)
    with pytest.raises(QinferError, match="state_snapshots=8: kv_cache_memory of") as error:
        LLM(model, max_num_seqs=2, kv_cache_memory=10 * per_slot, state_snapshots=8)
    assert "\n" not in str(error.value)
    with pytest.raises(QinferError, match="engine argument state_snapshots must be"):
        LLM(model, state_snapshots=-1)


def test_the_step_channel_carries_the_state_slots():
    """A tensor-parallel worker gets each sequence's slot with its step."""
    step = ScheduledStep([[5, 6], [7]], [0, 10], [[[1], [4, 5, 6]]], [1, 1], state_slots=[3, 0])
    header, payload = pack(step)
    assert header.tolist() == [2, 3, 1, 4, 2]
    assert unpack(header.tolist(), payload.tolist()) == step

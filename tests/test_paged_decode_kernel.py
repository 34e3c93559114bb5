"""qinfer.kernels.paged_decode_attention and kernels.rope, the compiled decode attention and
RoPE of the CPU path: the attention against softmax(q k^T * scale) v in fp64 over exactly
the keys a query may see (block tables, sliding windows, tables that start past position
0), each query the same alone as in any batch and on any thread count, the step's K/V
stored where their slots say, bad inputs refused in one line; RoPE bit for bit torch's
`RoPE.apply`; and the engine's greedy tokens the same with the ops as with torch's.

Tolerances: fp32 outputs within 2e-6 of fp64 (the kernel's exp is within 2 ulp, its sums
fp32); bf16 outputs one bf16 unit (2^-7 relative, plus an absolute 2^-9 for values near 0).
"""

from __future__ import annotations

import pytest
import torch
from capped import in_capped_process

from qinfer import kernels
from qinfer.attention.kv_pool import LayerKV, store_kv
from qinfer.attention.kv_quant import kv_format
from qinfer.layers.rope import RoPE

BLOCK = 16
SHORT = (5, 37, 60)
# several of the kernel's chunks of 256 keys each: a long sequence's chunks are tasks of
# their own, combined in order (flash decoding)
LONG = (5, 300, 777)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    reason = kernels.available()
    if reason is not None:
        pytest.skip(reason)


def reference(q, keys, values, positions, tables, totals, key_starts, window, scale):
    """fp64 softmax(q k^T * scale) v of each (sequence, head) over the keys it may see:
    positions [max(start, p - window + 1), min(total, p + 1)) of its table."""
    G, Hq, D = q.shape
    Hkv = keys.shape[0]
    out = torch.empty(G, Hq, D, dtype=torch.float64)
    for g in range(G):
        start = 0 if key_starts is None else int(key_starts[g])
        p = int(positions[g])
        first = start if window is None else max(start, p - window + 1)
        seen = range(first, min(int(totals[g]), p + 1))
        slots = [int(tables[g, (j - start) // BLOCK]) * BLOCK + (j - start) % BLOCK for j in seen]
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            scores = (q[g, h].double() * scale) @ keys[kv, slots].double().T
            out[g, h] = torch.softmax(scores, -1) @ values[kv, slots].double()
    return out


def case(
    q_dtype, pool_dtype, sliding: bool, seed: int = 0, D: int = 64, heads=(6, 2), totals=SHORT
):
    """Three sequences (`totals` keys: 5, 37 and 60, or LONG ones of several chunks) over
    shuffled blocks of a pool, one new token each; sliding: tables starting at blocks 0, 1
    and 2 of each history (a window space); heads: (query heads, KV heads)."""
    gen = torch.Generator().manual_seed(seed)
    (Hq, Hkv), G = heads, 3
    totals = torch.tensor(totals)
    key_starts = torch.tensor([0, 16, 32]) if sliding else None
    starts = key_starts if sliding else torch.zeros(G, dtype=torch.long)
    width = -(-int((totals - starts).max()) // BLOCK)
    num_blocks = max(40, G * width)
    keys = torch.randn(Hkv, num_blocks * BLOCK, D, generator=gen).to(pool_dtype)
    values = torch.randn(Hkv, num_blocks * BLOCK, D, generator=gen).to(pool_dtype)
    positions = totals - 1
    # (G, W) views of a wider buffer, as the step's tables are
    tables = torch.zeros(G, width + 4, dtype=torch.long)
    tables[:, :width] = torch.randperm(num_blocks, generator=gen)[: G * width].view(G, width)
    tables = tables[:, :width]
    offsets = positions - starts
    slots = tables[torch.arange(G), offsets // BLOCK] * BLOCK + offsets % BLOCK
    q = torch.randn(G, Hq, D, generator=gen).to(q_dtype)
    k = torch.randn(G, Hkv, D, generator=gen).to(q_dtype)
    v = torch.randn(G, Hkv, D, generator=gen).to(q_dtype)
    return dict(
        q=q, k=k, v=v, keys=keys, values=values, slots=slots, positions=positions,
        tables=tables, totals=totals, key_starts=key_starts,
    )  # fmt: skip


def run(c: dict, window: int | None, scale: float = 0.125, rows=slice(None)) -> torch.Tensor:
    """The op on sequences `rows` of case c."""
    pick = {
        name: value if name in POOL or value is None else value[rows] for name, value in c.items()
    }
    return kernels.paged_decode_attention(**pick, block_size=BLOCK, window=window, scale=scale)


DTYPES = [torch.float32, torch.bfloat16]
#: A case's pool tensors: whole in every call (its other tensors are per sequence).
POOL = ("keys", "values", "key_scales", "value_scales")
#: kv_quant's int8 storage (fp16 scales per 32 elements of a row, or one a row)
INT8 = kv_format("int8", torch.float32)


def int8_pool(c: dict) -> dict:
    """Case c's pool quantized as kv_quant's int8: keys, values and their scales."""
    (keys, key_scales), (values, value_scales) = (INT8.quantize(c[n]) for n in ("keys", "values"))
    return {"keys": keys, "values": values, "key_scales": key_scales, "value_scales": value_scales}


WINDOWS = [(None, False, SHORT), (7, False, SHORT), (20, True, SHORT)]
# several chunks: from the first key, from a window's first (mid-block), and from a window's
# first in a table that starts past position 0
LONG_WINDOWS = [(None, False, LONG), (300, False, LONG), (300, True, LONG)]


@pytest.mark.parametrize("q_dtype", DTYPES)
@pytest.mark.parametrize("pool_dtype", DTYPES)
@pytest.mark.parametrize(("window", "sliding", "totals"), [*WINDOWS, *LONG_WINDOWS])
@pytest.mark.parametrize("D", [64, 40])
def test_attention_is_softmax_over_the_keys_each_query_sees(
    q_dtype, pool_dtype, window, sliding, totals, D
):
    c = case(q_dtype, pool_dtype, sliding, D=D, totals=totals)
    out = run(c, window)
    assert out.dtype == q_dtype and out.shape == c["q"].shape
    # the new k, v are in the pool at their slots, rounded to its dtype
    assert torch.equal(c["keys"][:, c["slots"]], c["k"].to(pool_dtype).transpose(0, 1))
    assert torch.equal(c["values"][:, c["slots"]], c["v"].to(pool_dtype).transpose(0, 1))
    want = reference(c["q"], c["keys"], c["values"], c["positions"], c["tables"], c["totals"],
                     c["key_starts"], window, 0.125)  # fmt: skip
    if q_dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-6)
    else:
        torch.testing.assert_close(out.double(), want, rtol=2.0**-7, atol=2.0**-9)


@pytest.mark.parametrize(("window", "sliding", "totals"), [*WINDOWS, *LONG_WINDOWS])
@pytest.mark.parametrize("heads", [(6, 2), (10, 2), (4, 1)])
def test_each_query_is_the_same_alone_in_any_batch_and_on_any_thread_count(
    window, sliding, totals, heads
):
    """The query heads of a KV head share a task, up to 4 and fewer where tasks would be
    fewer than twice the threads, and a long sequence's chunks are tasks of their own:
    each head's output is the same in any grouping (1 and 16 threads group differently),
    and within fp32 rounding of fp64."""
    c = case(torch.float32, torch.bfloat16, sliding, seed=1, heads=heads, totals=totals)
    together = run(c, window)
    want = reference(c["q"], c["keys"], c["values"], c["positions"], c["tables"], c["totals"],
                     c["key_starts"], window, 0.125)  # fmt: skip
    torch.testing.assert_close(together.double(), want, rtol=0, atol=2e-6)
    for g in range(3):
        assert torch.equal(run(c, window, rows=slice(g, g + 1))[0], together[g])
    assert torch.equal(run(c, window, rows=[2, 0, 1]), together[[2, 0, 1]])
    threads = torch.get_num_threads()
    try:
        for count in (1, 16):
            torch.set_num_threads(count)
            assert torch.equal(run(c, window), together)
    finally:
        torch.set_num_threads(threads)


def test_keys_scored_minus_infinity_get_no_weight_even_a_whole_chunk_of_them():
    """A key whose score is -inf (an infinite key element) weighs nothing, as in softmax,
    also when every key of a chunk is one (that chunk's max is then -inf)."""
    c = case(torch.float32, torch.float32, False, totals=LONG)
    g, first_chunk = 1, range(256)  # sequence 1 has 300 keys: chunks [0, 256) and [256, 300)
    slots = [int(c["tables"][g, j // BLOCK]) * BLOCK + j % BLOCK for j in first_chunk]
    c["keys"][:, slots, 0] = float("-inf")
    c["q"][g, :, 0] = c["q"][g, :, 0].abs() + 0.5
    out = run(c, None)
    want = reference(c["q"], c["keys"], c["values"], c["positions"], c["tables"], c["totals"],
                     c["key_starts"], None, 0.125)  # fmt: skip
    assert out.isfinite().all()
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-6)


def test_a_table_that_leaves_the_pool_is_refused_by_name():
    c = case(torch.float32, torch.bfloat16, False)
    c["tables"] = c["tables"].clone()
    c["tables"][1, 0] = 40  # the pool has blocks 0..39
    with pytest.raises(RuntimeError, match="block 40 in the table of sequence 1 is outside"):
        run(c, None)
    c = case(torch.float32, torch.bfloat16, False)
    c["slots"] = c["slots"].clone()
    c["slots"][0] = -1
    with pytest.raises(RuntimeError, match="slot -1 of sequence 0 is outside the pool"):
        run(c, None)
    c = case(torch.float32, torch.bfloat16, False)
    c["totals"] = c["totals"] + 100
    with pytest.raises(RuntimeError, match="sequence 0 at position 4 with 105 keys does not fit"):
        run(c, None)


def test_bad_tensors_are_refused_by_name():
    c = case(torch.float32, torch.bfloat16, False)
    with pytest.raises(RuntimeError, match="paged_decode_attention: k must be"):
        run({**c, "k": c["k"].bfloat16()}, None)
    with pytest.raises(RuntimeError, match="paged_decode_attention: values must match keys"):
        run({**c, "values": c["values"].float()}, None)
    with pytest.raises(RuntimeError, match="paged_decode_attention: slots must be"):
        run({**c, "slots": c["slots"].int()}, None)
    with pytest.raises(RuntimeError, match="do not share 2 KV heads evenly"):
        run({**c, "q": c["q"][:, :5]}, None)


@pytest.mark.parametrize("tokens", [5, 700])  # 700 x 6 heads of 64: split between threads
@pytest.mark.parametrize("rotary", [64, 24])
def test_rope_is_torchs_rotation_bit_for_bit(rotary, tokens):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 9, 64, generator=gen)[:, 1:7]  # a wider projection's heads: strided
    cos, sin = (torch.randn(tokens, 1, rotary // 2, generator=gen) for _ in range(2))
    got = kernels.rope(x, cos[:, 0], sin[:, 0])
    assert torch.equal(got, RoPE.apply(x, cos, sin))
    with pytest.raises(RuntimeError, match="rope: x must be"):
        kernels.rope(x.bfloat16(), cos[:, 0], sin[:, 0])


def test_the_layers_take_torchs_ops_when_switched_off(torch_ops_only):
    """`QINFER_CPU_KERNELS=off` (read once, by `kernels.in_use`) gives the pure-torch path:
    RoPE.apply's own ops, the paged backend's own decode arithmetic."""
    from qinfer.attention.backend import choose_backend
    from qinfer.core.features import Features
    from qinfer.layers import rope as rope_module

    cpu = torch.device("cpu")
    assert choose_backend("paged", cpu, Features()).decode_kernel
    assert not choose_backend("paged", cpu, Features(batch_invariant=True)).decode_kernel
    with torch_ops_only():
        assert not kernels.in_use()
        assert not choose_backend("paged", cpu, Features()).decode_kernel
        x, cos = torch.randn(2, 3, 8), torch.randn(2, 1, 4)
        assert not rope_module._compiled(x, cos)


def test_k_v_stored_already_give_the_same_output():
    """k, v and slots None (decode tokens beside prompt chunks, whose step stored every
    token's K/V before attending): the output of the op that stores them itself."""
    c = case(torch.float32, torch.bfloat16, True, seed=2)
    stored = run(c, 20)
    again = run({**c, "k": None, "v": None, "slots": None}, 20)
    assert torch.equal(again, stored)
    with pytest.raises(RuntimeError, match="k, v and slots are given together"):
        run({**c, "k": None}, 20)


@pytest.mark.parametrize("pool_dtype", [*DTYPES, torch.int8])
@pytest.mark.parametrize("D", [72, 64])
def test_the_avx2_and_scalar_paths_give_the_automatic_paths_bits(tmp_path, pool_dtype, D):
    """The op's loops, compiled for each path (each with its own widening of a bf16 pool,
    its own dequantizing of an int8 one), round alike: capped at AVX2 and at the scalar path
    (ATEN_CPU_CAPABILITY caps the ops' automatic paths) in fresh processes, the outputs and
    the stored pools (an int8 pool's scales too) are this process's bit for bit, over several
    chunks of keys and 3 query heads a KV head."""
    if kernels.norm_auto_path() == "scalar":
        pytest.skip("this CPU runs no vector path to compare with")
    int8 = pool_dtype == torch.int8
    c = case(torch.float32, torch.float32 if int8 else pool_dtype, False, D=D, totals=LONG)
    if int8:
        c |= int8_pool(c)
    pool = [name for name in POOL if name in c]
    call = (
        f"(lambda c: (kernels.paged_decode_attention(**c, block_size={BLOCK}, window=None, "
        f"scale=0.125), *(c[n] for n in {pool})))(dict(zip(inputs[0], inputs[1:])))"
    )
    # the pools as they are before this process's call stores the step's k and v
    inputs = [list(c), *(v.clone() if isinstance(v, torch.Tensor) else v for v in c.values())]
    here = run(c, None)
    for capability in ("avx2", "default"):
        out, *stored = in_capped_process(capability, tmp_path, call, *inputs)
        assert torch.equal(out, here), capability
        for name, tensor in zip(pool, stored, strict=True):
            assert torch.equal(tensor, c[name]), (capability, name)


@pytest.mark.parametrize("q_dtype", DTYPES)
@pytest.mark.parametrize(("window", "sliding", "totals"), [(None, False, LONG), (20, True, SHORT)])
@pytest.mark.parametrize(("D", "N"), [(64, 2), (72, 1)])  # N scales a row: per 32, or per row
def test_an_int8_pool_attends_as_the_fp32_pool_of_its_dequantized_values(
    q_dtype, window, sliding, totals, D, N
):
    """An int8 pool (kv_quant's "int8": fp16 scales per 32 elements, or one a row where 32
    does not divide D) gives, bit for bit, the output of an fp32 pool holding its values
    dequantized (exact in fp32), over several chunks of keys and within windows."""
    c = case(q_dtype, torch.float32, sliding, seed=3, D=D, totals=totals)
    assert INT8.scales_per_vector(D) == N
    pool = int8_pool(c)
    dequantized = {
        "keys": INT8.dequantize(pool["keys"], pool["key_scales"], torch.float32),
        "values": INT8.dequantize(pool["values"], pool["value_scales"], torch.float32),
    }
    stored = {"k": None, "v": None, "slots": None}
    expected = run({**c, **stored, **dequantized}, window)
    assert torch.equal(run(c | stored | pool, window), expected)


def test_an_int8_pool_is_refused_without_its_scales_and_scales_without_one():
    """An int8 pool without its scales, scales beside an fp32 pool, and scales of the wrong
    dtype: each refused in one line."""
    c = case(torch.float32, torch.float32, False)
    pool = int8_pool(c)
    int8 = {**c, "keys": pool["keys"], "values": pool["values"], "k": None, "v": None}
    int8["slots"] = None
    scales = {"key_scales": pool["key_scales"], "value_scales": pool["value_scales"]}
    with pytest.raises(RuntimeError, match="key_scales is given with an int8 pool"):
        run(int8, None)
    with pytest.raises(RuntimeError, match="value_scales is given with an int8 pool"):
        run(int8 | {"key_scales": pool["key_scales"]}, None)
    with pytest.raises(RuntimeError, match="key_scales is given with an int8 pool"):
        run(c | scales, None)
    with pytest.raises(RuntimeError, match=r"value_scales must be contiguous \(2, \d+, N\) fp16"):
        run(int8 | scales | {"value_scales": pool["value_scales"].float()}, None)


@pytest.mark.parametrize("q_dtype", DTYPES)
def test_an_int8_pool_stores_k_and_v_as_kv_quant_quantizes_them(q_dtype):
    """k and v stored by the op into an int8 pool: the values and scales `store_kv` writes
    (`KVFormat.quantize`), bit for bit, for blocks of zeros, of tiny values (a subnormal fp16
    scale) and of large ones; and the output that pool gives once torch stored them."""
    c = case(q_dtype, torch.float32, False, seed=4)
    c["k"][0, 0, :32] = 0
    c["k"][1, 1, 32:] *= 1e-5
    c["v"][2, 0, :32] *= 1e4
    pool = int8_pool(c)
    by_op = {name: t.clone() for name, t in pool.items()}
    out = run(c | by_op, None)
    tiny = by_op["key_scales"][1, c["slots"][1], 1]  # the scaled-down block's: a subnormal
    assert 0 < tiny < torch.finfo(torch.float16).smallest_normal
    by_torch = {name: t.clone() for name, t in pool.items()}
    store_kv(LayerKV(*(by_torch[name] for name in POOL), INT8), c["slots"], c["k"], c["v"])
    for name in POOL:
        assert torch.equal(by_op[name], by_torch[name]), name
    assert not torch.equal(by_op["key_scales"], pool["key_scales"])  # the op wrote some
    stored = {"k": None, "v": None, "slots": None}
    assert torch.equal(out, run(c | by_torch | stored, None))

"""qinfer.kernels.causal_attention, the compiled attention of a prompt's queries: the
reference's result, each query's bits its own (whole, in chunks, beside other sequences),
and the one-line refusals; and torch_sdpa_grouped's rule for taking it."""

from __future__ import annotations

import pytest
import torch
from capped import in_capped_process

from qinfer import kernels
from qinfer.attention import sdpa
from qinfer.attention.sdpa import scaled_dot_product_attention_grouped


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    reason = kernels.available()
    if reason is not None:
        pytest.skip(reason)


def qkv(B, Hq, Hkv, L, S, D, dtype=torch.float32, seed=0):
    """q (B, Hq, L, D) as a view of (B, L, Hq, D) (a projection's heads), k and v (B, Hkv,
    S, D) in `dtype`, KV heads that differ a lot (reading the wrong one shows)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, Hq, D, generator=g).transpose(1, 2)
    k = torch.randn(B, Hkv, S, D, generator=g) * torch.arange(1, Hkv + 1)[None, :, None, None]
    v = torch.randn(B, Hkv, S, D, generator=g) + 4 * torch.arange(Hkv)[None, :, None, None]
    return q, k.to(dtype), v.to(dtype)


@pytest.mark.parametrize(
    ("B", "Hq", "Hkv", "L", "S", "D"),
    [
        (1, 16, 8, 130, 130, 128),  # Qwen3's heads, a short last block of queries and keys
        (2, 6, 2, 100, 160, 16),  # a history before the queries, two sequences
        (1, 4, 1, 48, 48, 80),  # four query heads on one KV head, D not whole vectors
        (3, 9, 3, 7, 200, 64),  # a few queries after a long history
        (1, 2, 2, 1, 33, 256),  # one query
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_attention_equals_the_reference(B, Hq, Hkv, L, S, D, dtype):
    q, k, v = qkv(B, Hq, Hkv, L, S, D, dtype)
    scale = D**-0.5
    got = kernels.causal_attention(q, k, v, scale)
    want = scaled_dot_product_attention_grouped(q.double(), k.double(), v.double(), scale, "causal")
    assert got.dtype == torch.float32 and got.shape == (B, Hq, L, D)
    assert got.transpose(1, 2).is_contiguous()  # laid out (B, L, Hq, D): no copy to flatten
    torch.testing.assert_close(got, want.float(), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_query_gets_the_same_bits_whole_in_chunks_and_beside_others(dtype):
    """A query's output depends on its q, its own keys and values and D alone: a prompt in
    chunks (each chunk's queries against the history so far) and each sequence alone give
    the whole call's bits, as the engine's chunked prefill and prefix hits need."""
    q, k, v = qkv(2, 8, 2, 150, 150, 64, dtype)
    whole = kernels.causal_attention(q, k, v, 0.125)
    for start, stop in ((0, 37), (37, 40), (40, 150), (149, 150)):
        chunk = kernels.causal_attention(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], 0.125)
        assert torch.equal(chunk, whole[:, :, start:stop])
    for b in range(2):
        alone = kernels.causal_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], 0.125)
        assert torch.equal(alone, whole[b : b + 1])


def test_bad_inputs_are_refused_in_one_line():
    q, k, v = qkv(1, 4, 2, 5, 9, 16)
    with pytest.raises(RuntimeError, match="causal_attention: q must be"):
        kernels.causal_attention(q.bfloat16(), k, v, 0.25)
    with pytest.raises(RuntimeError, match="causal_attention: v must match k"):
        kernels.causal_attention(q, k, v.bfloat16(), 0.25)
    with pytest.raises(RuntimeError, match="S >= 9"):
        kernels.causal_attention(torch.randn(1, 4, 9, 16), k[:, :, :5], v[:, :, :5], 0.25)
    with pytest.raises(RuntimeError, match="Hkv dividing 4"):
        kernels.causal_attention(
            q, k[:, :1].expand(1, 3, 9, 16), v[:, :1].expand(1, 3, 9, 16), 0.25
        )


def test_causal_fp32_queries_take_the_op_and_without_it_causal_blocks(monkeypatch, torch_ops_only):
    """torch_sdpa_grouped's rule: causal fp32 queries on the CPU, K/V fp32 or bf16 alike,
    take the op where its AVX-512 path runs; elsewhere (the kernels off, an AVX2 CPU) a whole
    fp32 prompt within CAUSAL_BLOCKS_RANGE takes causal_blocks."""
    calls, blocks = [], []
    monkeypatch.setattr(kernels, "causal_attention", lambda *a: calls.append(a) or a[0])
    monkeypatch.setattr(sdpa, "causal_blocks", lambda *a: blocks.append(a) or a[0])
    for L, S, q_dtype, kv_dtype in (
        (128, 128, torch.float32, torch.float32),
        (130, 160, torch.float32, torch.bfloat16),
        (5, 9, torch.bfloat16, torch.bfloat16),  # bf16 queries: torch's kernels
    ):
        q, k, v = qkv(1, 4, 2, L, S, 16)
        if kernels.norm_auto_path() != "avx512" and q_dtype != kv_dtype:
            continue  # torch's kernels take one dtype
        sdpa.torch_sdpa_grouped(q.to(q_dtype), k.to(kv_dtype), v.to(kv_dtype), 0.35, "causal")
    if kernels.norm_auto_path() == "avx512":
        assert [a[0].shape[2] for a in calls] == [128, 130] and not blocks
    else:
        assert not calls and [a[0].shape[2] for a in blocks] == [128]
    taken = len(calls)
    blocks.clear()
    with torch_ops_only():
        for L, S in ((128, 128), (127, 127), (130, 160)):
            sdpa.torch_sdpa_grouped(*qkv(1, 4, 2, L, S, 16), 0.35, "causal")
    assert [a[0].shape[2] for a in blocks] == [128] and len(calls) == taken


def test_the_scalar_path_gives_the_avx512_bits(tmp_path):
    """The op's two paths round alike: run capped at the scalar one (torch's
    ATEN_CPU_CAPABILITY=default, which caps the ops' automatic paths too) in a fresh process,
    its output is this process's bit for bit."""
    if kernels.norm_auto_path() != "avx512":
        pytest.skip("this CPU runs no AVX-512 path to compare with")
    q, k, v = qkv(2, 9, 3, 40, 70, 64, torch.bfloat16)
    capped = in_capped_process(
        "default", tmp_path, "kernels.causal_attention(*inputs, 0.125)", q, k, v
    )
    assert torch.equal(capped, kernels.causal_attention(q, k, v, 0.125))

"""Quantized models: loading with `quantize=`, GGUF files keeping their blocks, and the
decode path's contract (no host syncs in `Transformer.forward`).

References: the same model with every Linear replaced by a dense fp32 one holding the
quantized kernel's own weights (`dequantize()`), which must give the same logits to fp32
precision; and the fp32 dequantized GGUF (the path tested against transformers), whose
greedy tokens the fast path must follow except at near-ties its numerical error explains.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import build_checkpoint, int4_kind, random_tokens
from gguf_files import (
    KL_OFFSETS,
    assert_greedy_follows,
    compare_greedy,
    kl_to_reference,
    real_text_ids,
    reference_scorer,
    smollm2_path,
)

import qinfer
from qinfer import kernels
from qinfer.core.errors import QinferError, WeightsError
from qinfer.linear import DenseLinear, Int8BlockLinear, Int8Linear, choose

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3")
    build_checkpoint(folder, "qwen3", tie_word_embeddings=True, head_dim=32)
    return folder


def densified(model: qinfer.Transformer) -> qinfer.Transformer:
    """The model with each Linear swapped for a dense fp32 copy of the weight it computes with."""
    for name, w in model.linears().items():
        dense = DenseLinear(w.dequantize(), None if w.bias is None else w.bias.float())
        if w is model.lm_head:  # tied: listed once, as embed_tokens
            model.lm_head = dense
        model.set_submodule(name, dense)
    return model


@pytest.mark.parametrize("quantize, kind", [("int8", Int8Linear), ("int4", int4_kind())])
def test_quantized_model_computes_with_its_own_weights(qwen3_folder, quantize, kind):
    # exact: fp32 activations, so only the weights could differ from the densified copy
    # (the default's int8 activations are held to their KL bounds in test_numerics)
    load = dict(dtype="float32", quantize=quantize, device="cpu", exact=True)
    quantized = qinfer.load_model(qwen3_folder, **load)
    assert isinstance(quantized.layers[0].mlp.gate_up, kind)
    reference = densified(qinfer.load_model(qwen3_folder, **load))
    tokens = random_tokens(2, 12)
    torch.testing.assert_close(quantized(tokens), reference(tokens), rtol=1e-5, atol=1e-5)


def test_a_tied_head_is_quantized_once_as_int8_rows(qwen3_folder):
    model = qinfer.load_model(qwen3_folder, quantize="int4", device="cpu")
    assert model.lm_head is model.embed_tokens and isinstance(model.lm_head, Int8Linear)
    assert model.dtype == torch.bfloat16  # int kernels are fast only with bf16 activations


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_bf16_logits_stay_close_to_float32(qwen3_folder, quantize):
    """A sanity bound from the formats, not parity. Rounding to a step s leaves an error of
    std s / sqrt(12) per weight. Gaussian weights: an int4 group of 32 spans ~4 std in 15
    steps (error ~0.08 of the weights' std), an int8 row of 128 ~5.5 std in 254 steps
    (~0.006). The logits pass ~8 such matmuls (2 layers of q/k/v, o, gate/up, down, and
    the head), which add up in quadrature: ~0.22 (int4), ~0.02 (int8); bf16 activations
    add ~2^-9 per value."""
    reference = qinfer.load_model(qwen3_folder, dtype="float32", device="cpu")
    model = qinfer.load_model(qwen3_folder, quantize=quantize, device="cpu")
    tokens = random_tokens(2, 12)
    expected, got = reference(tokens), model(tokens)
    relative = (got - expected).norm() / expected.norm()
    print(f"{quantize}: relative logit error {relative:.4f}")
    assert relative < {"int8": 0.04, "int4": 0.3}[quantize]


def test_quantize_choices_are_checked(qwen3_folder):
    with pytest.raises(QinferError, match="unknown quantize 'int3'; use one of none, int8, int4"):
        qinfer.load_model(qwen3_folder, quantize="int3", device="cpu")
    with pytest.raises(
        QinferError, match="int4 group size must be one of 32, 64, 128, 256, got 48"
    ):
        qinfer.load_model(qwen3_folder, quantize="int4", group_size=48, device="cpu")
    # hidden 64: a group of 128 does not divide the q/k/v projection's 64 input features
    with pytest.raises(
        WeightsError, match=r"cannot quantize 'model.layers.0.self_attn.q_proj.weight': .*128"
    ):
        qinfer.load_model(qwen3_folder, quantize="int4", group_size=128, device="cpu")
    with pytest.raises(QinferError, match="quantize='int8' runs on cpu and cuda, not meta"):
        qinfer.load_model(qwen3_folder, quantize="int8", device="meta")


# ------------------------------------------------------------- the embedded SmolLM2


def test_smollm2_keeps_its_blocks_and_computes_in_fp32():
    """Every matrix of the file is a kind qinfer's kernels multiply exactly, so the
    activations are fp32 (bf16 where those kernels cannot be built here)."""
    model = qinfer.load_model(smollm2_path(), device="cpu")
    exact = kernels.available() is None
    assert model.dtype == (torch.float32 if exact else torch.bfloat16)
    assert qinfer.load_model(smollm2_path(), device="cpu", dtype="bfloat16").dtype == torch.bfloat16
    kinds = {type(w) for name, w in model.linears().items() if name.startswith("layers.")}
    assert kinds == {int4_kind()}  # every projection is Q4_1: int4 groups of 32, bit for bit
    assert isinstance(model.lm_head, Int8BlockLinear)  # Q8_0 embedding, tied: its blocks
    weight_bytes = sum(w.nbytes for w in model.linears().values())
    # Q4_1 takes 20 bytes a group of 32 in the file; qinfer's exact kernel 24 (fp32 d, m)
    assert weight_bytes < (1.15 if exact else 1.05) * smollm2_path().stat().st_size


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


def test_smollm2_greedy_follows_float32_except_at_near_ties():
    """32 greedy tokens of the kept-blocks bf16 model against the fp32 dequantized model.
    Where they part, the reference's top choice must lead the fast path's choice by less
    than the logit error measured at that very position: a near-tie, reported, not a bug."""
    path = smollm2_path()
    tokenizer = qinfer.load_tokenizer(path)
    fast = qinfer.load_model(path, device="cpu")
    reference = qinfer.load_model(path, dtype="float32", device="cpu")
    comparisons = [compare_greedy(fast, reference, tokenizer.encode(p)) for p in PROMPTS]
    # Which prompts agree for all 32 tokens depends on the CPU's kernels (on the
    # AVX512-BF16 development machine: 1 of 4, the other 3 parting at near-ties); the top-1
    # agreement on the reference's path measured 123/128 there (real text: 95% top-1 in the
    # KL test below, llama.cpp's 94.6%).
    assert_greedy_follows(comparisons, min_top1=0.9)


#: llama.cpp 0.3.36's own drift on the same file and text, by where the windows start
#: (`gguf_files.KL_OFFSETS`), from `python bench/kl_divergence.py [--offset 300]`
#: (tests/real_text.txt, 3 windows of 512; AMD EPYC, AVX512-BF16, 2026-12-04): mean
#: KL(fp32 reference || llama.cpp) and its top-1 agreement. qinfer's default path measured
#: 0.00457 with a bf16 residual stream and bf16 logits (2026-12-01); 0.00307 with them in
#: fp32; 0.00041 with the Q8_0 embedding and tied head kept in its blocks (2026-12-03);
#: 0.00003 (top-1 99.74%; from token 300 0.00003, 99.48%) with the int4 groups kept exact
#: too and fp32 activations (2026-12-04), now `exact=True`. The default path, int8
#: activations per block of 32 on the int4 groups (the Q8_0 head kept exact), measured
#: 0.00212 (top-1 95.42%; from token 300 0.00217, 95.82%) on the AVX512-VNNI/AMX Xeon
#: (2026-12-05); with the head on int8 activations too (its top 256 recomputed exactly)
#: 0.00254 (96.34%; from token 300 0.00242, 95.95%) on the AMD EPYC (2026-12-07). Bounds: the default path 0.75x llama.cpp's, `exact` half of it (a return
#: to bf16 activations, 0.003, fails both).
SMOLLM2_LLAMA_CPP = {0: (0.00358, 0.9464), 300: (0.00352, 0.9490)}
#: The share of llama.cpp's KL each mode may drift: {exact: share}.
KL_SHARE = {False: 0.75, True: 0.5}


@pytest.fixture(scope="module")
def smollm2_float32_log_probs():
    """The embedded file's fp32 dequantization's log-probs of each KL window, computed once
    for the module's KL tests."""
    return reference_scorer(qinfer.load_model(smollm2_path(), dtype="float32", device="cpu"))


@pytest.mark.parametrize("exact", [False, True], ids=["int8_activations", "exact"])
@pytest.mark.parametrize("offset", KL_OFFSETS)
def test_smollm2_default_path_drifts_from_float32_less_than_llama_cpp(
    smollm2_float32_log_probs, offset, exact
):
    """The default load (Q4_1 kept as int4 groups times int8 activations per block of 32,
    the Q8_0 embedding and tied head as its int8 blocks, the head on int8 activations with
    each row's top 256 logits recomputed exactly, fp32 residual and logits; `exact`: fp32
    activations and the exact head) against the exact fp32 dequantization, on real text from the
    document's start and from mid-document, as llama-perplexity measures it: no more than
    0.75x llama.cpp's own KL on the same file and windows (`exact`: half), and top-1
    agreement above llama.cpp's."""
    path = smollm2_path()
    ids = real_text_ids(qinfer.load_tokenizer(path), offset)
    fast = qinfer.load_model(path, device="cpu", exact=exact)
    assert fast.lm_head.head_path == ("kernel" if exact else "int8_dot")
    result = kl_to_reference(fast, ids, smollm2_float32_log_probs)
    kl, top1 = SMOLLM2_LLAMA_CPP[offset]
    assert result.kl <= kl * KL_SHARE[exact], result
    assert result.top1 >= top1, result


@pytest.mark.parametrize("offset", KL_OFFSETS)
def test_smollm2_exact_head_on_the_default_path_keeps_the_bound(
    smollm2_float32_log_probs, offset, monkeypatch
):
    """`QINFER_LINEAR_PATH=head=kernel`: the default path with the exact fp32 head (the
    default's int8_dot head, its top 256 recomputed, measured 0.00254 and 0.00242; the exact
    head 0.00223 and 0.00217; with the top 16 only, 0.00291 and 0.00274 broke the bound,
    2026-12-07)."""
    monkeypatch.setenv(choose.ENV, "head=kernel")
    path = smollm2_path()
    ids = real_text_ids(qinfer.load_tokenizer(path), offset)
    fast = qinfer.load_model(path, device="cpu")
    assert fast.lm_head.head_path == "kernel"
    result = kl_to_reference(fast, ids, smollm2_float32_log_probs)
    kl, top1 = SMOLLM2_LLAMA_CPP[offset]
    assert result.kl <= kl * KL_SHARE[False], result
    assert result.top1 >= top1, result


#: The same runs with `--kv-cache`: llama.cpp with flash attention and its q8_0 KV cache
#: (blocks of 32 with an fp16 scale; 0.00372 and 95.56% with its f16 cache from the start).
#: qinfer's default path with an int8 KV cache measured 0.00521 and 93.33% with one scale
#: per token and head, 0.00354 and 95.43% with one per block of 32 (2026-12-03), 0.00038
#: and 98.43% (from token 300 0.00035, 98.43%) with the weights exact (2026-12-04; the fp32
#: reference with an int8 KV cache alone: 0.00040; with an fp8 cache the default path
#: measured 0.00469), now `exact=True`; the default path with int8 activations 0.00250
#: and 96.34% (from token 300 0.00245, 96.21%; 2026-12-05). Bounds as the default path's
#: (`KL_SHARE`).
SMOLLM2_LLAMA_CPP_Q8_KV = {0: (0.00386, 0.9595), 300: (0.00392, 0.9477)}


@pytest.mark.parametrize("exact", [False, True], ids=["int8_activations", "exact"])
@pytest.mark.parametrize("offset", KL_OFFSETS)
def test_smollm2_int8_kv_cache_drifts_from_float32_no_further_than_llama_cpp_q8_0(
    smollm2_float32_log_probs, offset, exact
):
    """The default load with an int8 KV cache (blocks of 32, as q8_0's) against the exact
    fp32 dequantization, on real text from the start and from mid-document: no more than
    0.75x llama.cpp's own KL with its q8_0 cache (`exact`: half), and top-1 agreement no
    more than a point below llama.cpp's."""
    path = smollm2_path()
    ids = real_text_ids(qinfer.load_tokenizer(path), offset)
    fast = qinfer.load_model(path, device="cpu", kv_cache_dtype="int8", exact=exact)
    result = kl_to_reference(fast, ids, smollm2_float32_log_probs)
    kl, top1 = SMOLLM2_LLAMA_CPP_Q8_KV[offset]
    assert result.kl <= kl * KL_SHARE[exact], result
    assert result.top1 >= top1 - 0.01, result


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantize_keeps_a_gguf_files_blocks_that_are_no_wider(quantize):
    """`quantize="int8"|"int4"` on the Q4_1 file re-rounds nothing: its Q4_1 groups are
    int4 already and its Q8_0 embedding (the tied head) stays in its int8 blocks, as the
    default load has them, so the logits are the default's bit for bit. (Re-rounding them was what
    `--quantize int8` did: KL 0.0063 against the default's 0.0031; llama.cpp's own
    requantization of this file measured 0.0048 to Q8_0 and 0.28 to Q4_0, 2026-12-03,
    `python bench/kl_divergence.py --quantize`.)"""
    path = smollm2_path()
    default = qinfer.load_model(path, device="cpu")
    quantized = qinfer.load_model(path, device="cpu", quantize=quantize)
    assert type(quantized.layers[0].mlp.gate_up) is type(default.layers[0].mlp.gate_up)
    tokens = random_tokens(1, 12)
    assert torch.equal(quantized(tokens), default(tokens))


# ------------------------------------------------------------- the decode contract


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_forward_never_syncs_with_the_host(qwen3_folder, monkeypatch, kv_cache_dtype):
    """`forward` is what the runner and decode loops call every step: nothing in it may read
    a tensor's value back to Python (which waits for the device), quantizing its K/V
    included."""
    model = qinfer.load_model(
        qwen3_folder, dtype="float32", device="cpu", kv_cache_dtype=kv_cache_dtype
    )
    for padding in (None, [0, 3]):
        cache = model.make_cache(2, left_padding=padding)
        model(random_tokens(2, 6), cache=cache)  # the checked prefill
        step = random_tokens(2, 1)

        def refuse(*args, **kwargs):
            raise AssertionError("host sync inside Transformer.forward")

        with monkeypatch.context() as patch:
            for method in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
                patch.setattr(torch.Tensor, method, refuse)
            logits = model.run_rows(step, cache[0].offsets, cache)
        assert logits.shape == (2, 1, 256)

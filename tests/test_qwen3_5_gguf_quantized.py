"""A quantized Qwen3.5 GGUF on the default path: int8 activations on every Linear, fp32
elsewhere, drifting from the fp32 dequantized file no further than llama.cpp does; and the
K-quant files llama.cpp's users run (Q4_K_M, Q5_K_M, Q6_K) loading and drifting within a
stated share of llama.cpp's; Qwen3.5-MoE's and Qwen3-Next's files from llama.cpp's quantizer
(which writes their shared expert's gate 1-D) likewise.

The files: llama.cpp's converter writes the random checkpoint as F32 and Q8_0 (its Q8_0 keeps
the DeltaNet's conv kernels F32), and llama.cpp's `llama_model_quantize` takes the F32 file to
Q4_0 (the projections Q4_0; the tied embedding, 64 columns, Q8_0; conv kernels and norms F32).
A conv kernel is a 2-D tensor but no Linear: it must not send the model to bf16 activations
(`weights.gguf.exact_kernels` counts only what `weights.load.quantizable_weights` names).

The drift is measured as llama-perplexity measures it (`analysis.perplexity.score`): KL(fp32
dequantized || engine) on the second half of each chunk of random token ids, for qinfer's
default path and for llama.cpp on the same file in the same run (its Q8_0/Q4_0 matmuls also
round activations to 8 bits per block of 32).
"""

from __future__ import annotations

import ctypes
import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from checkpoints import CHAT_VOCAB_SIZE, HYBRID, build_chat_checkpoint, int4_kind, random_tokens
from test_vl_gguf import convert

import qinfer
from qinfer.analysis.perplexity import score, scored_log_probs
from qinfer.linear import Int8BlockLinear
from qinfer.linear.paths import INT8_DOT, QuantizedLinear

pytestmark = pytest.mark.slow

try:  # the peer, where installed (qinfer[peer]): scored live, and it writes the Q4_0 file
    import llama_cpp
except ImportError:
    llama_cpp = None

#: llama.cpp's file types (llama_ftype) MOSTLY_Q4_0 and MOSTLY_Q8_0.
LLAMA_FTYPE_Q4_0, LLAMA_FTYPE_Q8_0 = 2, 7
#: tests/checkpoints.py's Qwen3.5 with key and value heads of 32: llama.cpp takes them to be
#: of one size, and value heads of a whole block keep out_proj's blocks (`gguf_deltanet`).
SHAPES = dict(HYBRID["qwen3_5"], linear_key_head_dim=32, linear_value_head_dim=32)
#: Both engines round the activations to 8 bits per block of 32 against the same blocks.
#: Measured on the 2-core Xeon (AMX), 2026-12-06, mean KL(fp32 || engine) / top-1:
#: Q8_0 qinfer 0.00320 / 87.8%, llama.cpp 0.00318 / 88.4%; Q4_0 qinfer 0.00607 / 88.4%,
#: llama.cpp 0.00361 / 92.1%, qinfer `exact` (fp32 activations) 0.00297 / 91.5%. So the
#: bounds, by file type, as a share of llama.cpp's KL: the default path 1.1x on Q8_0, but 2x
#: on Q4_0 (an open gap, not a target): this untied model's Q4_0 embedding table is taken to
#: int8 rows for its lookups (`weights.base._quantized`: int4 kinds cannot read single
#: rows), re-rounded, where llama.cpp reads the exact Q4_0 rows; that alone is the exact
#: path's 0.00297 (its Q8_0 file: 0.000008). The exact path within llama.cpp's on both. Top-1
#: within 4% of llama.cpp's (a random model's distributions are near-flat, full of near-ties).
KL_SHARE = {"q8_0": 1.1, "q4_0": 2.0}
#: llama.cpp's (KL, top-1) on the same files and ids, as measured above: the bound where
#: llama-cpp-python is not installed (the files are seeded, so they are the same files).
LLAMA_CPP = {"q8_0": (0.00318, 0.884), "q4_0": (0.00361, 0.921)}
TOP1_SLACK = 0.04
#: Chunks of random ids scored (each on its second half), as llama-perplexity scores text.
CONTEXT, CHUNKS = 128, 3


def add_a_merge(folder: Path) -> None:
    """Give the checkpoint's byte-level tokenizer one BPE merge (" t", the vocabulary's last
    id): llama.cpp refuses a BPE vocabulary without merges; the ids scored here are random."""
    path = folder / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    tokenizer["model"]["vocab"]["\u0120t"] = CHAT_VOCAB_SIZE - 1
    tokenizer["model"]["merges"] = [["\u0120", "t"]]
    path.write_text(json.dumps(tokenizer))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The random Qwen3.5's F32, Q8_0 (the converter's) and Q4_0 (llama.cpp's) files."""
    root = tmp_path_factory.mktemp("qwen3_5_quantized")
    build_chat_checkpoint(root / "hf", "qwen3_5", **SHAPES)
    add_a_merge(root / "hf")
    paths = {outtype: root / f"{outtype}.gguf" for outtype in ("f32", "q8_0", "q4_0")}
    convert(
        root / "hf",
        *(["--no-mtp", "--outtype", t, "--outfile", str(paths[t])] for t in ("f32", "q8_0")),
    )
    if llama_cpp is None:
        del paths["q4_0"]
        return paths
    llama_quantize(paths["f32"], paths["q4_0"], LLAMA_FTYPE_Q4_0)
    return paths


def llama_quantize(source: Path, target: Path, ftype: int) -> None:
    """llama.cpp's `llama_model_quantize` of the F32 file `source` to file type `ftype`."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, 2
    failed = llama_cpp.llama_model_quantize(
        str(source).encode(), str(target).encode(), ctypes.byref(params)
    )
    assert failed == 0


def llama_cpp_scorer(path: Path):
    """The same from llama.cpp on the file, through its C API. Without its extra buffer
    types (`use_extra_bufts`: weights repacked for its AMX / AVX-512 tiles), which crash
    llama.cpp 0.3.36 on this model's 64-column matrices; its plain Q8_0 / Q4_0 dot products
    round the activations to Q8_0 blocks of 32 all the same."""
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    context_params = llama_cpp.llama_context_default_params()
    context_params.n_ctx = context_params.n_batch = CONTEXT
    context_params.n_threads = context_params.n_threads_batch = 2
    context = llama_cpp.llama_init_from_model(model, context_params)
    assert model and context
    batch = llama_cpp.llama_batch_init(CONTEXT, 0, 1)
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))

    def scorer(chunk: torch.Tensor) -> torch.Tensor:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(context), True)
        n = len(chunk)
        for i, token in enumerate(chunk.tolist()):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = n // 2 <= i < n - 1
        batch.n_tokens = n
        assert llama_cpp.llama_decode(context, batch) == 0
        rows = [
            np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(context, i), (vocab,))
            for i in range(n // 2, n - 1)
        ]
        return torch.log_softmax(torch.tensor(np.stack(rows)), dim=-1)

    return scorer


@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
def test_quantized_file_runs_int8_activations_within_llama_cpps_drift(files, outtype):
    """The default load of a Q8_0 / Q4_0 file: fp32 activations (the conv kernels, F32 in
    the file, do not count against it), every layer's Linears on the int8-activation path
    (int8 blocks / int4 groups as stored); its KL from the fp32 dequantized file within
    KL_SHARE of llama.cpp's on the same file and ids, the exact path's within llama.cpp's."""
    if outtype not in files:
        pytest.skip("llama-cpp-python (qinfer[peer]) writes the Q4_0 file: not installed")
    path = files[outtype]
    fast = qinfer.load_model(path, device="cpu")
    assert fast.dtype == torch.float32
    kind = Int8BlockLinear if outtype == "q8_0" else int4_kind()
    deltanet, attention = fast.layers[0].linear_attn, fast.layers[1].self_attn
    for layer in (deltanet.in_proj, deltanet.out_proj, attention.wqkv, fast.layers[0].mlp.down):
        assert type(layer) is kind, type(layer)
    linears = [m for block in fast.layers for m in block.modules()]
    linears = [m for m in linears if isinstance(m, QuantizedLinear)]
    assert len(linears) == 4 * 4  # in_proj/out_proj or wqkv/wo, gate_up, down per layer
    assert all(m.chosen == {"decode": INT8_DOT, "prefill": INT8_DOT} for m in linears)

    reference = partial(scored_log_probs, qinfer.load_model(path, device="cpu", dtype="float32"))
    ids = random_tokens(1, CONTEXT * CHUNKS, seed=3, vocab=CHAT_VOCAB_SIZE)[0].tolist()
    if llama_cpp is None:
        kl, top1 = LLAMA_CPP[outtype]
        theirs = SimpleNamespace(kl=kl, top1=top1)
    else:
        theirs = score(llama_cpp_scorer(path), ids, CONTEXT, reference)
    exact = qinfer.load_model(path, device="cpu", exact=True)
    for model, share in ((fast, KL_SHARE[outtype]), (exact, 1.0)):
        ours = score(partial(scored_log_probs, model), ids, CONTEXT, reference)
        print(f"{outtype} exact={model.features.exact}: qinfer {ours}\nllama.cpp {theirs}")
        assert 0 < ours.kl <= share * theirs.kl, (ours, theirs)
        assert ours.top1 >= theirs.top1 - TOP1_SLACK, (ours, theirs)


#: A Qwen3.5 whose matrices are 256 columns wide (hidden 256; DeltaNet heads, attention
#: heads and the FFN a multiple of 256 wide): llama.cpp quantizes a matrix to a K-quant only
#: where its rows are whole super-blocks of 256, and falls back to older types elsewhere.
K_SHAPES = dict(
    HYBRID["qwen3_5"],
    hidden_size=256,
    intermediate_size=512,
    head_dim=64,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        mrope_section=[4, 2, 2],
        mrope_interleaved=True,
    ),
)
#: llama.cpp's file type (llama_ftype) of each K-quant file, the block types it then holds
#: (Q4_K_M and Q5_K_M keep some matrices Q6_K), and the bound on the default path's KL as a
#: share of llama.cpp's on the same file and ids. Measured on the 2-core Xeon (AMX),
#: 2026-12-06, mean KL(fp32 || engine) / top-1, qinfer then llama.cpp: Q4_K_M 0.0066 / 82.5%,
#: 0.0075 / 82.0% (int4 groups, int8 activations); Q6_K 0.0039 / 85.2%, 0.0079 / 82.5% (int8
#: blocks of 16); Q5_K_M 0.0098 / 79.4%, 0.0089 / 81.0% (Q5_K re-rounded to int8 blocks of
#: 32, `weights.gguf`, int8 activations; as int8 rows with bf16 activations, before the same
#: day's change, it was 0.0142 / 77.8%): a gap of a tenth, not a target.
K_QUANTS = {
    "q4_k_m": (15, {"Q4_K", "Q6_K"}, 1.1),
    "q5_k_m": (17, {"Q5_K", "Q6_K"}, 1.25),
    "q6_k": (18, {"Q6_K"}, 1.1),
}


@pytest.fixture(scope="module")
def k_quant_files(tmp_path_factory) -> dict[str, Path]:
    """The 256-wide random Qwen3.5's F32 file and llama.cpp's K-quant files of it."""
    if llama_cpp is None:
        pytest.skip("llama-cpp-python (qinfer[peer]) writes the K-quant files: not installed")
    root = tmp_path_factory.mktemp("qwen3_5_k_quants")
    build_chat_checkpoint(root / "hf", "qwen3_5", **K_SHAPES)
    add_a_merge(root / "hf")
    paths = {outtype: root / f"{outtype}.gguf" for outtype in ("f32", *K_QUANTS)}
    convert(root / "hf", ["--no-mtp", "--outtype", "f32", "--outfile", str(paths["f32"])])
    for outtype, (ftype, _, _) in K_QUANTS.items():
        llama_quantize(paths["f32"], paths[outtype], ftype)
    return paths


@pytest.mark.parametrize("outtype", K_QUANTS)
def test_a_k_quant_file_loads_and_drifts_within_its_share_of_llama_cpps(k_quant_files, outtype):
    """A K-quant file holds the K-quant blocks it is named for (the matrices are wide
    enough), loads by default and runs: its KL from the fp32 dequantized file within
    K_QUANTS' share of llama.cpp's on the same file and ids, top-1 within TOP1_SLACK."""
    from qinfer.weights.gguf_file import read_gguf

    _, kinds, share = K_QUANTS[outtype]
    path = k_quant_files[outtype]
    stored = {t.tensor_type.name for t in read_gguf(path).tensors if len(t.shape) > 1}
    assert stored - {"F32"} == kinds, stored
    reference = partial(scored_log_probs, qinfer.load_model(path, device="cpu", dtype="float32"))
    ids = random_tokens(1, CONTEXT * CHUNKS, seed=3, vocab=CHAT_VOCAB_SIZE)[0].tolist()
    theirs = score(llama_cpp_scorer(path), ids, CONTEXT, reference)
    ours = score(
        partial(scored_log_probs, qinfer.load_model(path, device="cpu")), ids, CONTEXT, reference
    )
    print(f"{outtype}: qinfer {ours}\nllama.cpp {theirs}")
    assert 0 < ours.kl <= share * theirs.kl, (ours, theirs)
    assert ours.top1 >= theirs.top1 - TOP1_SLACK, (ours, theirs)


#: The MoE hybrids with their shared expert 64 wide: every matrix a whole number of blocks
#: of 32, so llama.cpp's quantizer leaves none in F16 (which would take the model to bf16).
MOE_SHAPES = {
    family: dict(
        HYBRID[family],
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        shared_expert_intermediate_size=64,
    )
    for family in ("qwen3_5_moe", "qwen3_next")
}


@pytest.fixture(scope="module", params=sorted(MOE_SHAPES))
def moe_q8_0(request, tmp_path_factory) -> Path:
    """A MoE hybrid's F32 file as llama.cpp's quantizer takes it to Q8_0."""
    if llama_cpp is None:
        pytest.skip("llama-cpp-python (qinfer[peer]) writes the quantized file: not installed")
    root = tmp_path_factory.mktemp(request.param)
    build_chat_checkpoint(root / "hf", request.param, **MOE_SHAPES[request.param])
    add_a_merge(root / "hf")
    f32, q8_0 = root / "f32.gguf", root / "q8_0.gguf"
    convert(root / "hf", ["--no-mtp", "--outtype", "f32", "--outfile", str(f32)])
    llama_quantize(f32, q8_0, LLAMA_FTYPE_Q8_0)
    return q8_0


def test_a_moe_file_from_llama_cpps_quantizer_loads_within_its_drift(moe_q8_0):
    """The quantizer writes the shared expert's gate (1, hidden) as (hidden,) (a GGUF's
    trailing dims of 1 are not significant): read as (1, hidden), the file loads on the
    int8-activation path and drifts within KL_SHARE of llama.cpp on the same file and ids."""
    from qinfer.weights.gguf_file import read_gguf

    gates = [t for t in read_gguf(moe_q8_0).tensors if "ffn_gate_inp_shexp" in t.name]
    assert gates and all(len(t.shape) == 1 for t in gates)
    fast = qinfer.load_model(moe_q8_0, device="cpu")
    assert fast.dtype == torch.float32
    reference = partial(
        scored_log_probs, qinfer.load_model(moe_q8_0, device="cpu", dtype="float32")
    )
    ids = random_tokens(1, CONTEXT * CHUNKS, seed=3, vocab=CHAT_VOCAB_SIZE)[0].tolist()
    theirs = score(llama_cpp_scorer(moe_q8_0), ids, CONTEXT, reference)
    ours = score(partial(scored_log_probs, fast), ids, CONTEXT, reference)
    print(f"qinfer {ours}\nllama.cpp {theirs}")
    assert 0 < ours.kl <= KL_SHARE["q8_0"] * theirs.kl, (ours, theirs)
    assert ours.top1 >= theirs.top1 - TOP1_SLACK, (ours, theirs)

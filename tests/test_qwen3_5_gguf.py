"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next from GGUF files written by llama.cpp's own converter
(`qwen35`, `qwen35moe`, `qwen3next`; models/qwen3_5.py, models/qwen3_next.py,
weights/gguf_deltanet.py), against transformers in fp32.

The random checkpoints have more value heads than key heads (4 and 2), so the converter
tiles Qwen3.5's value heads and the loader must untile them. Qwen3.5's value heads are 32
wide: in its Q8_0 file `out_proj`'s columns move by whole blocks of 32; Qwen3.5-MoE's are 16
wide, so its `out_proj` is dequantized instead. Qwen3-Next's value heads stay in order, but
the converter splits its `in_proj_qkvz` (grouped by key head) into q/k/v and z, which the
layer reads as they are (`DeltaNetConfig.projections`). The converter runs as
tests/test_vl_gguf.py runs it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from checkpoints import HYBRID, build_chat_checkpoint, max_diff, random_tokens, reference_logits
from safetensors.torch import load_file, save_file
from test_qwen3_5_engine import GREEDY, LENGTHS, NEW_TOKENS, SMALL, prompts
from test_vl_gguf import convert

import qinfer
from qinfer.attention.deltanet import CHUNK_SIZE
from qinfer.core.errors import WeightsError
from qinfer.engine import LLM
from qinfer.linear import DenseLinear, Int8BlockLinear
from qinfer.models import config_from_hf
from qinfer.models.qwen3_next import GGUF_PROJECTIONS
from qinfer.weights.gguf_file import read_gguf

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4  # fp32 logits of order 1 to 10, as tests/test_qwen3_5.py
PROMPT = CHUNK_SIZE + 36  # two chunks of the DeltaNet, the second ragged
SHAPES = {
    "qwen3_5": dict(HYBRID["qwen3_5"], linear_value_head_dim=32),
    "qwen3_5_moe": HYBRID["qwen3_5_moe"],
    "qwen3_next": HYBRID["qwen3_next"],
}
#: The DeltaNet's projections in a family's file, where they are not stored as in its folder.
FILE_PROJECTIONS = {"qwen3_next": GGUF_PROJECTIONS}
#: out_proj's kind with its Q8_0 blocks kept: dequantized where its columns, untiled, would
#: split blocks (Qwen3.5-MoE's value heads of 16).
Q8_OUT_PROJ = {
    "qwen3_5": Int8BlockLinear,
    "qwen3_5_moe": DenseLinear,
    "qwen3_next": Int8BlockLinear,
}
#: A DeltaNet tensor each family's file must hold: llama.cpp's name, ours.
NEEDED = {
    "qwen3_5": ("blk.0.ssm_conv1d.weight", "linear_attn.conv1d.weight"),
    "qwen3_5_moe": ("blk.0.ssm_conv1d.weight", "linear_attn.conv1d.weight"),
    "qwen3_next": ("blk.0.ssm_ba.weight", "linear_attn.in_proj_ba.weight"),
}
OUTTYPES = ("f32", "f16", "q8_0")


@dataclass(frozen=True)
class Files:
    """One family's checkpoint folder, transformers' model, and its converted files."""

    family: str
    folder: Path
    reference: torch.nn.Module
    gguf: dict[str, Path]  # outtype -> file (no MTP head); "mtp": f32 with it


def add_mtp_head(folder: Path) -> None:
    """Give a saved checkpoint a one-layer MTP head as released Qwen3.5 checkpoints have
    (`mtp.*` tensors, `mtp_num_hidden_layers`): a copy of its full-attention layer 1 and
    random fc/norms. transformers does not read them; the converter writes them as
    `blk.{layers}.*` and `nextn_predict_layers`."""
    weights = load_file(folder / "model.safetensors")
    hidden = weights["model.norm.weight"].shape[0]
    generator = torch.Generator().manual_seed(5)
    prefix = "model.layers.1."
    weights |= {
        f"mtp.layers.0.{name[len(prefix) :]}": w.clone()
        for name, w in weights.items()
        if name.startswith(prefix)
    }
    weights["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=generator)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))


@pytest.fixture(scope="module", params=sorted(SHAPES))
def files(request, tmp_path_factory) -> Files:
    family = request.param
    root = tmp_path_factory.mktemp(family)
    folder, with_mtp = root / "hf", root / "hf-mtp"
    reference = build_chat_checkpoint(folder, family, **SHAPES[family])
    paths = {outtype: root / f"{outtype}.gguf" for outtype in OUTTYPES}
    convert(
        folder,
        *(["--no-mtp", "--outtype", t, "--outfile", str(paths[t])] for t in OUTTYPES),
    )
    build_chat_checkpoint(with_mtp, family, **SHAPES[family])
    add_mtp_head(with_mtp)
    paths["mtp"] = root / "mtp.gguf"
    convert(with_mtp, ["--outtype", "f32", "--outfile", str(paths["mtp"])])
    return Files(family, folder, reference, paths)


def load(path: Path, **kwargs) -> qinfer.Transformer:
    return qinfer.load_model(path, device="cpu", **{"dtype": torch.float32, **kwargs})


def test_config_from_metadata_equals_the_folders(files):
    """The layer kinds, the DeltaNet's shapes, the gated attention and its partial rotary,
    the experts, read from the file's metadata alone, are the folder's config; the
    DeltaNet's projections are those the file stores."""
    ours = load(files.gguf["f32"]).config
    folder = config_from_hf(json.loads((files.folder / "config.json").read_text()))
    assert ours.deltanet.num_value_heads > ours.deltanet.num_key_heads  # the reorder runs
    stored = FILE_PROJECTIONS.get(files.family, folder.deltanet.projections)
    assert ours.deltanet.projections == stored
    ours = dataclasses.replace(
        ours, deltanet=dataclasses.replace(ours.deltanet, projections=folder.deltanet.projections)
    )
    for field in ("layer_types", "deltanet", "wiring", "rope", "moe", "head_dim"):
        assert getattr(ours, field) == getattr(folder, field), field


def test_f32_logits_equal_transformers(files):
    """Two rows of PROMPT tokens through the F32 file: transformers' logits."""
    tokens = random_tokens(2, PROMPT)
    expected = reference_logits(files.reference, tokens)
    assert expected.abs().max() > 1
    assert max_diff(load(files.gguf["f32"])(tokens), expected) < TOLERANCE


def test_f16_logits_equal_transformers_with_its_matrices_rounded(files):
    """The F16 file holds every matrix but the conv kernel and the routers in fp16: its
    logits are transformers' with those weights rounded so."""
    rounded = files.reference.__class__(files.reference.config).eval()
    rounded.load_state_dict(files.reference.state_dict())
    kept_fp32 = ("conv1d", "mlp.gate.weight", "shared_expert_gate")
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if p.dim() > 1 and not any(part in name for part in kept_fp32):
                p.copy_(p.half().float())
    tokens = random_tokens(2, PROMPT)
    ours = load(files.gguf["f16"])(tokens)
    assert max_diff(ours, reference_logits(files.reference, tokens)) > 10 * TOLERANCE
    assert max_diff(ours, reference_logits(rounded, tokens)) < TOLERANCE


def test_q8_0_blocks_kept_equal_the_dequantized_file(files):
    """The Q8_0 file with its int8 blocks kept (the DeltaNet's rows and out_proj's columns
    moved with their scales): each DeltaNet projection computes what the same file
    dequantized to fp32 computes, on fp32 inputs. Qwen3.5's out_proj keeps its blocks;
    Qwen3.5-MoE's (heads of 16 columns, half a block) is dequantized. (The whole model on
    the default path: tests/test_qwen3_5_gguf_quantized.py.)"""
    kept = load(files.gguf["q8_0"], dtype=None, exact=True)
    dequantized = load(files.gguf["q8_0"])
    assert type(kept.layers[0].linear_attn.out_proj) is Q8_OUT_PROJ[files.family]
    assert type(kept.layers[0].linear_attn.in_proj) is Int8BlockLinear
    generator = torch.Generator().manual_seed(2)
    for i in (0, 2):  # the linear-attention layers
        ours, theirs = kept.layers[i].linear_attn, dequantized.layers[i].linear_attn
        for name in ("in_proj", "out_proj"):
            mine, reference = getattr(ours, name), getattr(theirs, name)
            if isinstance(mine, DenseLinear):  # dequantized: the same values in bf16
                assert torch.equal(mine.weight, reference.weight.to(mine.weight.dtype))
                continue
            x = torch.randn(3, reference.in_features, generator=generator)
            assert max_diff(mine(x).float(), reference(x)) < 1e-5, (i, name)


def test_a_file_with_the_mtp_head_loads_as_without(files):
    """The converter's nextn blocks (the MTP head) are counted in block_count and left out:
    the same layers, the same logits."""
    metadata = read_gguf(files.gguf["mtp"]).metadata
    arch = metadata["general.architecture"]
    assert metadata[f"{arch}.nextn_predict_layers"] == 1
    assert metadata[f"{arch}.block_count"] == files.reference.config.num_hidden_layers + 1
    model = load(files.gguf["mtp"])
    assert model.config.num_hidden_layers == files.reference.config.num_hidden_layers
    tokens = random_tokens(1, 40)
    assert max_diff(model(tokens), reference_logits(files.reference, tokens)) < TOLERANCE


def test_greedy_tokens_through_the_engine_equal_transformers(files):
    """Three prompts through `LLM.generate` (small blocks, chunked prefill) from the F32
    file: each one's greedy tokens are transformers' greedy generate of it alone."""
    reference = files.reference
    reference.generation_config.eos_token_id = None  # as ignore_eos
    ids = prompts(LENGTHS)
    llm = LLM(load(files.gguf["f32"]), **SMALL)
    ours = [out.token_ids for out in llm.generate(ids, GREEDY, use_tqdm=False)]
    for prompt, tokens in zip(ids, ours, strict=True):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False
            )
        assert tokens == out[0, len(prompt) :].tolist()


def patched(source: Path, target: Path, name: str, replace: bytes) -> Path:
    """A copy of GGUF `source` with the header bytes of tensor `name` and what follows
    them (its dims) overwritten by `replace`, from the name's first byte."""
    data = bytearray(source.read_bytes())
    at = data.index(name.encode())
    assert data.count(name.encode()) == 1
    data[at : at + len(replace)] = replace
    target.write_bytes(bytes(data))
    return target


def test_a_missing_deltanet_tensor_is_one_line_error(files, tmp_path):
    """A DeltaNet tensor renamed away (`blk.` to `xlk.`): the load names the tensor it
    needs, by our name and llama.cpp's."""
    name, ours = NEEDED[files.family]
    path = patched(files.gguf["f32"], tmp_path / "missing.gguf", name, f"x{name[1:]}".encode())
    with pytest.raises(WeightsError, match=rf"{re.escape(ours)}' not found") as error:
        load(path)
    assert "\n" not in str(error.value) and f"missing.gguf (as {name})" in str(error.value)


def test_a_mis_shaped_deltanet_tensor_is_one_line_error(files, tmp_path):
    """blk.0.ssm_conv1d.weight with 64 channels where the model has 128: both shapes and
    the tensor named, by our name and llama.cpp's."""
    name = "blk.0.ssm_conv1d.weight"
    stored = files.gguf["f32"].read_bytes()
    at = stored.index(name.encode()) + len(name)
    n_dims, kernel = stored[at : at + 4], stored[at + 4 : at + 12]
    channels = 64
    replace = name.encode() + n_dims + kernel + channels.to_bytes(8, "little")
    path = patched(files.gguf["f32"], tmp_path / "shape.gguf", name, replace)
    with pytest.raises(WeightsError, match=r"conv1d\.weight'.*has shape \(64, 1, 4\)") as error:
        load(path)
    assert "\n" not in str(error.value) and name in str(error.value)

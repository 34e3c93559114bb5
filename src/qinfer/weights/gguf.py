"""GGUF checkpoints (llama.cpp's single-file format): the config and weights of one `.gguf`.

The file's header is read by `qinfer.weights.gguf_file`; this module maps llama.cpp's
conventions onto ours:

- metadata (`llama.attention.head_count`, `qwen2.rope.freq_base`, ...) -> a Hugging Face
  style config dict -> the family's config reader (`qinfer.models`, found by
  `general.architecture`), so both formats share one validation; what an architecture says
  beyond llama.cpp's shared keys is read by its family's file;
- tensor names (`blk.3.attn_q.weight`) -> ours (`model.layers.3.self_attn.q_proj.weight`),
  by the family's names;
  a mixture of experts' stacked tensors (`blk.3.ffn_gate_exps.weight`, (experts, out, in))
  -> one tensor per expert (`model.layers.3.mlp.experts.7.gate_proj.weight`), each a view
  of its slice of the file;
- q/k rows of the families whose converter permutes them for llama.cpp's interleaved
  RoPE (llama, `Family.gguf_qk_permuted`), back to the rotate-half layout our RoPE (and every HF checkpoint) uses;
- Gemma's and Qwen3.5's norm weights, which the converter stores as the whole scale 1 + w,
  back to the w of a Hugging Face checkpoint (our norms add the 1:
  `Wiring.norm_weight_offset`);
- a hybrid model's Gated DeltaNet tensors back to the Hugging Face layout
  (`weights.gguf_deltanet`);
- quantized blocks: kept in their bits where a kernel can use them as they are (Q4_0,
  Q4_1 and Q4_K are int4 groups of 32 exactly, `gguf_quants.int4_groups`; Q8_0, Q5_0 and
  Q6_K int8 blocks of 32 or 16 exactly, `gguf_quants.int8_blocks`); the other block types
  (Q5_1, Q2_K, Q3_K, Q5_K) become int8 blocks of 32, re-rounded (each value within half of
  its block's step of 1/127 of the block's largest: far finer than their own 2-5 bits), so
  that they run on the same kernels, and the model on the same activations, as the kept
  kinds. With `dtype="float32"` asked every tensor is dequantized to fp32 by
  `gguf_quants.dequantize` instead, one tensor at a time when the model asks for it.

The reader already gives tensors in numpy (row-major) order: a GGUF tensor of dims
ne = [in, out] arrives as (out, in), the layout of a Hugging Face weight.

By default the blocks are kept. The activations are fp32 where every matrix the model
multiplies as a Linear (not a conv kernel, a router or a norm, which llama.cpp keeps F32) is
an int4 group or int8 block kind and qinfer's kernels load (`exact_kernels`: they multiply the
exact weight by fp32 activations, as fast as torch's int4 kernel in bf16), bf16 otherwise
(torch's int kernels are fast only with bf16 activations). `dtype="float32"` asked (or
`quantize="none"`) dequantizes every tensor to fp32 instead: exact values, the reference
the tests compare with transformers.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from qinfer import kernels
from qinfer.core.errors import ConfigError, WeightsError
from qinfer.core.model_config import ModelConfig, RopeConfig
from qinfer.core.rope_scaling import rope_frequencies
from qinfer.linear import Int4Groups, Int8Blocks, StoredWeight, quantize_int8_blocks
from qinfer.linear.int8 import CHUNK_ROWS
from qinfer.models import Family, GGUFHeader, family_of_gguf
from qinfer.models.base import HFConfig
from qinfer.weights.base import ALL, Quantize, Weights
from qinfer.weights.gguf_deltanet import DeltaNetTensors, gathered
from qinfer.weights.gguf_file import GGUFFile, TensorInfo, read_gguf
from qinfer.weights.gguf_quants import (
    BLOCK_DEQUANTIZERS,
    INT4_GROUPS,
    INT8_BLOCKS,
    SUPPORTED_TYPES,
    dequantize,
    int4_groups,
    int8_blocks,
)

# llama.cpp tensor name -> ours; blk.N.* names are per layer, each family's
# (`Family.gguf_layer_names`).
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
#: Stacked expert tensors (experts, out, in) -> each expert's projection.
EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# Tokens llama.cpp also stops on, found by their text whatever the metadata names
# (llama-vocab.cpp): Gemma's chat turns end with <end_of_turn>.
END_OF_TURN_TOKENS = ("<end_of_turn>",)
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
#: Any per-layer tensor: a family may map a whole name (`blk.N.ssm_a`, which has no suffix).
LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")
#: Norms the converter stores as they are where it adds 1 to the others (the DeltaNet's
#: gated norm: `Qwen3NextModel.modify_tensors`).
UNCENTRED_NORMS = (".linear_attn.norm.weight",)
#: The MTP head's (`qinfer.model.mtp_head`): llama.cpp's converter writes it as blocks past
#: the model's, `blk.<L>.nextn.<kind>.weight` for its own tensors (ours by kind) and that
#: block's attention and FFN under the usual names (ours: `mtp.layers.<n>.*`).
NEXTN_TENSOR = re.compile(r"blk\.(\d+)\.nextn\.(\w+)\.weight")
NEXTN_NAMES = {
    "eh_proj": "mtp.fc.weight",
    "enorm": "mtp.pre_fc_norm_embedding.weight",
    "hnorm": "mtp.pre_fc_norm_hidden.weight",
    "shared_head_norm": "mtp.norm.weight",
}
#: Norms the converter centres (its names, enorm and hnorm, end in "norm") that ours do not
#: name so.
CENTRED_MTP_NORMS = ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")
# Llama 3.1+ files store their RoPE scaling as per-frequency divisors, not as metadata.
ROPE_FREQS = "rope_freqs.weight"
# Block types kept quantized: int4 groups and int8 blocks as they are, the others
# re-rounded to int8 rows.
REROUNDED_TYPES = tuple(t for t in BLOCK_DEQUANTIZERS if t not in (*INT4_GROUPS, *INT8_BLOCKS))
KEPT_TYPES = (*INT4_GROUPS, *INT8_BLOCKS, *REROUNDED_TYPES)


def hf_tensor_name(gguf_name: str, layer_names: Mapping[str, str]) -> str | None:
    """Our name for a llama.cpp tensor name, with `layer_names` the family's per-layer names
    (a kind, `attn_q`, whose suffix is kept, or a whole name, `ssm_a` or `ssm_dt.bias`), or
    None for a tensor we do not use."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    whole = LAYER_NAME.fullmatch(gguf_name)
    if whole is not None and whole.group(2) in layer_names:
        return f"model.layers.{whole.group(1)}.{layer_names[whole.group(2)]}"
    match = LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in layer_names:
        return None
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{layer_names[kind]}.{suffix}"


def gguf_tensor_name(name: str, layer_names: Mapping[str, str]) -> str | None:
    """llama.cpp's name of our tensor `name` (`hf_tensor_name`'s inverse; the family's later
    names win, as they override the shared ones), or None where it has none."""
    ours = {v: k for k, v in GLOBAL_NAMES.items()}
    if name in ours:
        return ours[name]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if match is None:
        return None
    layer, rest = match.groups()
    for kind, mapped in reversed(layer_names.items()):
        if rest == mapped:  # a whole name
            return f"blk.{layer}.{kind}"
        stem, _, suffix = rest.rpartition(".")
        if stem == mapped and suffix in ("weight", "bias"):
            return f"blk.{layer}.{kind}.{suffix}"
    return None


def open_gguf(
    path: str | Path,
    dtype_for: Callable[[ModelConfig, bool, bool], torch.dtype],
    device: torch.device,
    quantize: Quantize | None = None,
    keep_blocks: bool = True,
) -> tuple[ModelConfig, GGUFWeights]:
    """The config and (lazily read) weights of a `.gguf` file.

    keep_blocks: keep block-quantized tensors quantized, Q4_0/Q4_1/Q4_K as int4 groups,
    Q8_0/Q5_0/Q6_K as int8 blocks, the other block types re-rounded to int8 blocks of 32;
    float tensors
    are read as they are, and `quantize` then applies to them. dtype_for is told whether
    the weights are quantized and asks, of the weights the model multiplies as Linears,
    whether each is then one that qinfer's exact kernels multiply in fp32
    (`exact_kernels`). Blocks are never re-rounded
    to a kind as wide as theirs or wider: `quantize="int8"` keeps them all;
    `quantize="int4"` keeps the int4 groups and the int8 blocks (which `weights.base` takes
    to int4 groups from their exact values, but for a table embedding lookups read) and
    takes the other block types to int4 from theirs.
    """
    path = Path(path)
    file = read_gguf(path)
    config = config_from_gguf(file, path)
    family = family_of_gguf(file.metadata.get("general.architecture"), file.path)
    tensors = _text_tensors(file, family, config.num_hidden_layers)
    kept = keep_blocks and any(t.tensor_type in KEPT_TYPES for t in file.tensors)
    # `quantize` keeps what is exact and takes the rest to int4 groups of its size
    requantized_exact = quantize is None or quantize.kind == "int8" or quantize.group_size == 32

    def exact_kinds(names: Collection[str]) -> bool:
        linears = _stored_tensors(names, tensors, config, family)
        return kept and requantized_exact and exact_kernels(linears, device)

    dtype = dtype_for(config, kept or quantize is not None, exact_kinds)
    int4 = quantize is not None and quantize.kind == "int4"
    keep = () if not kept else (*INT4_GROUPS, *INT8_BLOCKS) if int4 else KEPT_TYPES
    # llama.cpp stores llama's q/k rows permuted for interleaved RoPE (see unpermute_rows);
    # the converter stores a Gemma norm's whole scale (1 + w), our norms add the offset
    # themselves (Wiring.norm_weight_offset), so it is taken back off, as transformers'
    # GGUF loader does.
    weights = GGUFWeights(
        file,
        tensors,
        dtype,
        device,
        keep,
        permuted_head_dim=config.head_dim if family.gguf_qk_permuted else None,
        norm_offset=config.wiring.norm_weight_offset,
        layer_names=family.gguf_layer_names,
        deltanet=None
        if config.deltanet is None
        else DeltaNetTensors(config.deltanet, family.gguf_value_heads_tiled),
    )
    return config, weights


def exact_kernels(linears: Collection[TensorInfo], device: torch.device) -> bool:
    """Whether every tensor of `linears` (those a model multiplies as Linears,
    `_stored_tensors`), its blocks kept, is one that qinfer's compiled kernels multiply
    exactly by fp32 activations (int4 groups: `Int4BlockLinear`; int8 blocks:
    `Int8BlockLinear`; the re-rounded block types are int8 blocks too) on `device`: a CPU
    where the kernels load (building them if need be). Float matrices are fast only in
    bf16. The file's other matrices (a DeltaNet's conv kernel, a router: llama.cpp keeps
    them F32) do not count."""
    if torch.device(device).type != "cpu" or not all(t.tensor_type in KEPT_TYPES for t in linears):
        return False
    return kernels.available() is None


def _stored_tensors(
    names: Collection[str], tensors: Mapping[str, TensorInfo], config: ModelConfig, family: Family
) -> list[TensorInfo]:
    """The file's tensors behind our weight `names`: a part of a fused tensor
    (`Family.fused_tensors`) is the fused one; a name the file lacks has none (the load names
    it)."""
    fused = {
        f"model.layers.{layer}.{part}.weight": f"model.layers.{layer}.{f.stored}.weight"
        for f in family.fused_tensors(config)
        for part, _ in f.parts
        for layer in range(config.num_hidden_layers)
    }
    stored = {fused.get(name, name) for name in names}
    return [tensors[name] for name in sorted(stored) if name in tensors]


def config_from_gguf(file: GGUFFile, path: Path) -> ModelConfig:
    """A ModelConfig from the `{arch}.*` and `tokenizer.ggml.*` metadata of a GGUF file: the
    keys every llama.cpp architecture shares are read here, what the architecture's family
    reads beyond them by its file (`Family.gguf_fields`), and the family's own config
    reader checks the whole, as for a config.json."""
    meta = file.metadata
    family = family_of_gguf(meta.get("general.architecture"), path)
    tensor_names = frozenset(t.name for t in file.tensors)

    def read_floats(name: str) -> list[float]:
        stored = file.tensor(name)
        return [float(x) for x in dequantize(file.read(stored), stored.tensor_type).flatten()]

    header = GGUFHeader(meta["general.architecture"], meta, tensor_names, read_floats)
    try:
        config = family.read_config(HFConfig(_shared_fields(header, family)))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    if ROPE_FREQS in tensor_names:
        config = _with_llama3_rope(config, file, path)
    return config


def _shared_fields(header: GGUFHeader, family: Family) -> dict[str, Any]:
    """The config.json fields llama.cpp's shared metadata keys say, and the family's (its
    `rope_parameters` join the shared ones)."""
    meta, arch = header.metadata, header.arch
    hidden, heads = int(header.need("embedding_length")), int(header.need("attention.head_count"))
    head_dim = int(header.get("attention.key_length") or hidden // heads)
    rotary_dims = int(header.get("rope.dimension_count", head_dim))
    vocab_size = header.get("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    end_ids = [
        meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")
    ]  # llama.cpp stops on any of these "end of generation" tokens
    end_ids += _end_of_turn_ids(meta)
    family_fields = family.gguf_fields(header)
    rope = {**_rope_parameters(meta, arch), **family_fields.pop("rope_parameters", {})}
    if rotary_dims != head_dim:  # llama.cpp rotates the first rope.dimension_count only
        rope["partial_rotary_factor"] = rotary_dims / head_dim
    return {
        "model_type": family.model_types[0],
        "vocab_size": vocab_size or None,
        "hidden_size": hidden,
        "intermediate_size": header.need("feed_forward_length"),
        "num_hidden_layers": header.need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": header.get("attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "rms_norm_eps": header.need("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": header.need("context_length"),
        "tie_word_embeddings": "output.weight" not in header.tensor_names,
        "rope_parameters": rope,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(int(i) for i in end_ids if i is not None)),
        "dtype": "float32",
        **family_fields,
    }


def _end_of_turn_ids(meta: dict[str, Any]) -> list[int]:
    """Ids of END_OF_TURN_TOKENS in the vocabulary (a few hundred at its start, where
    special tokens live, are searched)."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    head = tokens[:1024]
    return [head.index(token) for token in END_OF_TURN_TOKENS if token in head]


def _rope_parameters(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """`{arch}.rope.*` metadata -> HF `rope_parameters` (types: none, linear, yarn)."""
    params: dict[str, Any] = {"rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0)}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        params["rope_type"] = scaling
        params["factor"] = meta.get(f"{arch}.rope.scaling.factor")
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            params["original_max_position_embeddings"] = original
    return params


def _with_llama3_rope(config: ModelConfig, file: GGUFFile, path: Path) -> ModelConfig:
    """Recognise the llama3 RoPE scaling that `rope_freqs.weight` encodes.

    llama.cpp divides each inverse frequency by rope_freqs[i]. Its converter writes them
    from Llama 3.1's `rope_scaling` (factor, low/high_freq_factor 1 and 4, original
    context 8192 in every released Llama 3.x); we rebuild that config and check that it
    yields the same frequencies, so an unfamiliar file fails loudly instead of silently.
    """
    stored = file.tensor(ROPE_FREQS)
    divisors = torch.from_numpy(file.read(stored).astype(np.float32)).flatten()
    base = RopeConfig(theta=config.rope.theta)
    llama3 = RopeConfig(
        theta=config.rope.theta,
        type="llama3",
        factor=float(divisors.max()),
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    default_freq, _ = rope_frequencies(config.head_dim, base)
    llama3_freq, _ = rope_frequencies(config.head_dim, llama3)
    if divisors.shape != default_freq.shape or not torch.allclose(
        default_freq / divisors, llama3_freq, rtol=1e-5, atol=0
    ):
        raise ConfigError(
            f"{path}: {ROPE_FREQS} holds RoPE frequency factors that match no llama3 scaling "
            "qinfer knows (factor = max, low/high_freq_factor 1/4, original context 8192)"
        )
    return dataclasses.replace(config, rope=llama3)


def _text_tensors(file: GGUFFile, family: Family, num_layers: int) -> dict[str, TensorInfo]:
    """A text model's tensors under our names (the family's), stacked experts one per
    expert, the blocks from `num_layers` on as the MTP head's (`NEXTN_NAMES`); the tensors
    we do not use are left out."""
    tensors: dict[str, TensorInfo] = {}
    for stored in file.tensors:
        experts = _expert_tensors(stored)
        name = hf_tensor_name(stored.name, family.gguf_layer_names)
        for ours, info in (experts or {name: stored}).items():
            ours = _mtp_name(stored.name, ours, num_layers)
            if ours is not None:
                tensors[ours] = info
    return tensors


def _mtp_name(gguf_name: str, name: str | None, num_layers: int) -> str | None:
    """Our name of an MTP head's tensor (`NEXTN_NAMES`), else `name` (its name as a layer's,
    or None)."""
    nextn = NEXTN_TENSOR.fullmatch(gguf_name)
    if nextn is not None:
        return NEXTN_NAMES.get(nextn.group(2)) if int(nextn.group(1)) == num_layers else None
    layer = None if name is None else re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if layer is None or int(layer.group(1)) < num_layers:
        return name
    return f"mtp.layers.{int(layer.group(1)) - num_layers}.{layer.group(2)}"


class GGUFWeights(Weights):
    """Tensors of a GGUF file under our names, dequantized when `tensor(name)` asks."""

    def __init__(
        self,
        file: GGUFFile,
        tensors: Mapping[str, TensorInfo],
        dtype: torch.dtype,
        device: torch.device | str,
        keep_types: tuple[GGMLQuantizationType, ...] = (),
        permuted_head_dim: int | None = None,
        norm_offset: float = 0.0,
        layer_names: Mapping[str, str] | None = None,
        deltanet: DeltaNetTensors | None = None,
    ) -> None:
        """tensors: our name -> where it lies in the file. keep_types: the block types
        `_stored` gives quantized (int4 groups, int8 blocks or int8 rows, see the module's
        docstring); every other tensor is dequantized. permuted_head_dim: the head size of
        q/k rows stored permuted for interleaved RoPE (None: not permuted); norm_offset:
        what the file adds to every norm weight but UNCENTRED_NORMS (taken back off);
        layer_names: the family's llama.cpp names, to name a tensor the file lacks;
        deltanet: how the converter stored a hybrid model's DeltaNet tensors (undone)."""
        super().__init__(dtype, device)
        self.file, self.path = file, file.path
        self.keep_types = keep_types
        for stored in tensors.values():
            if stored.tensor_type not in SUPPORTED_TYPES:  # fail before loading anything
                raise WeightsError(
                    f"tensor {stored.name!r} in {self.path} has quantization type "
                    f"{stored.tensor_type.name}, which qinfer cannot dequantize "
                    f"(supported: {', '.join(t.name for t in SUPPORTED_TYPES)})"
                )
        self._tensors = dict(tensors)
        self._head_dim = permuted_head_dim
        self._norm_offset = norm_offset
        self._deltanet = deltanet
        self._layer_names = layer_names or {}

    def names(self) -> list[str]:
        return list(self._tensors)

    def where(self, name: str) -> str:
        """The file, and llama.cpp's name of the tensor where it holds one by our `name`."""
        stored = self._tensors.get(name)
        theirs = gguf_tensor_name(name, self._layer_names) if stored is None else stored.name
        return str(self.path) if theirs is None else f"{self.path} (as {theirs})"

    def _checked_shape(self, name: str, expected: tuple[int, ...] | None) -> tuple[int, ...]:
        """As `Weights._checked_shape`; a GGUF tensor's dims of 1 at the end of its ne (numpy's
        leading dims) are not significant, and llama.cpp's quantizer drops them (the shared
        expert's gate (1, hidden) becomes (hidden,)): a tensor stored without the leading 1s
        of `expected` is read with them, the same bytes."""
        stored = self._tensors.get(name)
        if stored is not None and expected is not None:
            ones = (1,) * (len(expected) - len(stored.shape))
            if ones and tuple(expected) == ones + stored.weight_shape:
                self._tensors[name] = dataclasses.replace(stored, shape=ones + stored.shape)
        return super()._checked_shape(name, expected)

    def _shape(self, name: str) -> tuple[int, ...]:
        shape = self._tensors[name].weight_shape
        return shape if self._deltanet is None else self._deltanet.shape(name, shape)

    def _read(self, name: str, rows: slice = ALL, columns: slice = ALL) -> torch.Tensor:
        stored = self._tensors[name]
        data, within = self._blocks(stored, rows, columns)
        weight = self._unpermuted(name, self._decode(stored, dequantize, data)[..., within])
        if self._deltanet is not None:
            weight = self._deltanet.value(
                name, gathered(weight, *self._gathers(name, rows, columns))
            )
        if (
            self._norm_offset
            and (name.endswith("norm.weight") or name in CENTRED_MTP_NORMS)
            and not name.endswith(UNCENTRED_NORMS)
        ):
            return weight - self._norm_offset
        return weight

    def _gathers(
        self, name: str, rows: slice, columns: slice
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The row and column gathers that undo the converter's order of DeltaNet tensor
        `name` (`gguf_deltanet`), which only a whole tensor takes."""
        assert self._deltanet is not None
        row_index, column_index = self._deltanet.rows(name), self._deltanet.columns(name)
        if (row_index is not None or column_index is not None) and (rows, columns) != (ALL, ALL):
            raise WeightsError(
                f"tensor {name!r} in {self.path} cannot be read in parts (split between "
                "tensor-parallel ranks): its value heads are stored out of order"
            )
        return row_index, column_index

    def _stored(self, name: str, rows: slice = ALL, columns: slice = ALL) -> StoredWeight:
        stored = self._tensors[name]
        if stored.tensor_type not in self.keep_types:
            return self._read(name, rows, columns)
        weight = self._kept(name, stored, rows, columns)
        if self._deltanet is None:
            return weight
        ours = gathered(weight, *self._gathers(name, rows, columns))
        return self._read(name) if ours is None else ours  # None: it would split blocks

    def _kept(self, name: str, stored: TensorInfo, rows: slice, columns: slice) -> StoredWeight:
        """A tensor of a kept block type as int4 groups or int8 blocks."""
        if stored.tensor_type in INT4_GROUPS:
            data, within = self._blocks(stored, rows, columns)
            groups = self._block_columns(name, self._decode(stored, int4_groups, data), within)
            groups.q, groups.scales, groups.zeros = (
                self._unpermuted(name, t) for t in (groups.q, groups.scales, groups.zeros)
            )
            return groups
        if stored.tensor_type in INT8_BLOCKS:
            data, within = self._blocks(stored, rows, columns)
            blocks = self._block_columns(name, self._decode(stored, int8_blocks, data), within)
            fields = (blocks.q, blocks.scales, blocks.super_scales)
            return Int8Blocks(*(None if t is None else self._unpermuted(name, t) for t in fields))
        # Re-rounded to int8 blocks of 32; dequantized a chunk of rows at a time, so a
        # large embedding never exists in fp32 whole.
        data, within = self._blocks(stored, rows, columns)
        chunks = [
            quantize_int8_blocks(dequantize(chunk, stored.tensor_type, self.device)[:, within])
            for chunk in np.array_split(data, max(1, len(data) // CHUNK_ROWS))
        ]
        q = self._unpermuted(name, torch.cat([c.q for c in chunks]))
        return Int8Blocks(q, self._unpermuted(name, torch.cat([c.scales for c in chunks])))

    def _blocks(self, stored: TensorInfo, rows: slice, columns: slice) -> tuple[np.ndarray, slice]:
        """The stored data of `rows`, in the whole blocks that cover `columns`, and where
        `columns` lie in the weights those blocks decode to."""
        if columns == ALL:
            return self.file.read(stored, rows), ALL
        weights, stored_columns = stored.block
        start, stop, _ = columns.indices(stored.weight_shape[-1])
        first, last = start // weights, -(-stop // weights)  # blocks
        data = self.file.read(stored, rows, slice(first * stored_columns, last * stored_columns))
        return data, slice(start - first * weights, stop - first * weights)

    def _block_columns(
        self, name: str, weight: Int4Groups | Int8Blocks, within: slice
    ) -> Int4Groups | Int8Blocks:
        """The int4 groups or int8 blocks of the columns `within` (whole ones, or one clear
        error)."""
        if within == ALL:
            return weight
        if isinstance(weight, Int4Groups):
            kind, g = "int4 groups", weight.group_size
        else:
            kind, g = "int8 blocks", weight.block_size
        if within.start % g or within.stop % g:
            raise WeightsError(
                f"tensor {name!r} in {self.path} cannot be split between tensor-parallel "
                f"ranks at its input columns: its {kind} of {g} columns would straddle "
                f"a rank's share of {within.stop - within.start} columns"
            )
        return weight.columns(within.start, within.stop)

    def _decode(self, stored: TensorInfo, decode: Callable, data: np.ndarray) -> Any:
        try:
            return decode(data, stored.tensor_type, self.device)
        except (ValueError, RuntimeError) as e:
            raise WeightsError(
                f"cannot read tensor {stored.name!r} ({stored.tensor_type.name}) from {self.path}: {e}"
            ) from None

    def _unpermuted(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """q/k rows (and their scales) of a llama file back in rotate-half order; whole
        heads, so a tensor-parallel rank's rows unpermute alone."""
        if self._head_dim is not None and name.split(".")[-2] in ("q_proj", "k_proj"):
            return unpermute_rows(rows, self._head_dim)
        return rows


def _expert_tensors(stored: TensorInfo) -> dict[str, TensorInfo]:
    """A stacked expert tensor (experts, out, in) as one (out, in) tensor per expert under
    our names, each where its slice lies in the file ({} for any other tensor)."""
    match = LAYER_TENSOR.fullmatch(stored.name)
    if match is None or match.group(2) not in EXPERT_NAMES or len(stored.shape) != 3:
        return {}
    layer, kind, suffix = match.groups()
    experts, *shape = stored.shape
    size = math.prod(shape) * stored.dtype.itemsize  # bytes of one expert
    return {
        f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_NAMES[kind]}.{suffix}": dataclasses.replace(
            stored, name=f"{stored.name}[{e}]", shape=tuple(shape), offset=stored.offset + e * size
        )
        for e in range(experts)
    }


def unpermute_rows(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Undo llama.cpp's `LlamaModel.permute` of a q/k projection (out, ...) or its bias.

    The converter reorders each head's D rows from rotate-half pairs (i, i + D/2) to
    adjacent pairs (2i, 2i + 1): rows viewed as (heads, 2, D/2) are stored as
    (heads, D/2, 2). Swapping the two axes back restores the Hugging Face order.
    """
    per_head = weight.reshape(-1, head_dim // 2, 2, *weight.shape[1:])  # (H, D/2, 2, ...)
    return per_head.transpose(1, 2).reshape(weight.shape)

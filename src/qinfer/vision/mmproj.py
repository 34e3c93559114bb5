"""llama.cpp's projector files (`--mmproj`): the vision tower and image settings of a Qwen-VL
or Qwen3.5 GGUF text model (architecture `qwen2vl`, `qwen3vl`, `qwen35` or `qwen35moe`),
which llama.cpp keeps in a file apart.

    encoder, settings = load_projector("mmproj.gguf", "model.gguf", model.config, dtype, device)

llama.cpp's converter (`convert_hf_to_gguf.py --mmproj`) writes the tower of a checkpoint
with `general.architecture` "clip", its projector in `clip.projector_type` and its shape in
`clip.vision.*` (block_count, embedding_length, feed_forward_length, attention.head_count,
patch_size, spatial_merge_size, projection_dim: the text model's hidden size, image_mean and
image_std, Qwen2.5-VL's n_wa_pattern, Qwen3-VL's is_deepstack_layers). Those keys become the
vision_config a Hugging Face folder has, read by the encoder's own config (`VisionConfig`,
`Qwen3VisionConfig`), and the tensors take the folder's names, so the encoders load a
projector file as they load a folder (`weights.load.load`):

    v.patch_embd.weight, .weight.1   the Conv3d kernel's two frames, (hidden, C, P, P) each
                                     -> visual.patch_embed.proj.weight (hidden, C, 2, P, P)
    v.patch_embd.bias                -> visual.patch_embed.proj.bias (Qwen3-VL)
    v.position_embd.weight           -> visual.pos_embed.weight (Qwen3-VL)
    v.blk.i.attn_q / _k / _v         -> visual.blocks.i.attn.q / .k / .v (Qwen2.5-VL)
    v.blk.i.attn_qkv                 -> visual.blocks.i.attn.qkv, split into q, k, v (Qwen3-VL)
    v.blk.i.attn_out, ln1, ln2       -> .attn.proj, .norm1, .norm2
    v.blk.i.ffn_gate / _up / _down   -> .mlp.gate_proj / up_proj / down_proj (Qwen2.5-VL),
                                        .mlp.linear_fc1 / linear_fc2 (Qwen3-VL: up, down)
    v.post_ln, mm.0, mm.2            -> the merger's norm and its two Linears
    v.deepstack.L.norm / fc1 / fc2   -> the DeepStack merger after block L (Qwen3-VL; llama.cpp
                                        appends its output to each image embedding's width,
                                        qinfer's tower hands it over apart)

Quantized tensors (F16, Q8_0, ...) are read as a GGUF text model's are (`weights.gguf`):
blocks kept as they are when `keep_blocks`, dequantized otherwise.

What the file does not store takes the values the family's released preprocessor and vision
configs give (`PROJECTORS`): the pixel budget of a resized image, Qwen2.5-VL's attention
window of 112 pixels (llama.cpp's too, whatever clip.vision.window_size says), a temporal patch of 2 frames (the only one the converter writes), the
2-D RoPE's theta 10000 and the norms' epsilon 1e-6 (fixed in transformers' towers).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qinfer.core.errors import ConfigError, WeightsError
from qinfer.core.features import Features
from qinfer.core.model_config import ModelConfig
from qinfer.vision.image import ImageSettings
from qinfer.vision.parts import split_qkv
from qinfer.vision.qwen2_5_vl import Qwen2_5_VisionEncoder, VisionConfig
from qinfer.vision.qwen3_vl import Qwen3_VisionEncoder, Qwen3VisionConfig
from qinfer.weights.base import ALL
from qinfer.weights.gguf import KEPT_TYPES, GGUFWeights, config_from_gguf
from qinfer.weights.gguf_file import GGUFFile, TensorInfo, read_gguf
from qinfer.weights.load import load

#: The prefix the tower's tensors take (the encoders' names of a Hugging Face folder).
PREFIX = "visual"
PATCH_EMBED = f"{PREFIX}.patch_embed.proj.weight"
#: The frames of the Conv3d kernel the converter splits it into (temporal_patch_size 2).
PATCH_FRAMES = ("v.patch_embd.weight", "v.patch_embd.weight.1")


@dataclass(frozen=True)
class Projector:
    """One llama.cpp projector type qinfer reads.

    family: the family's name, for errors; text_model_types: the `model_type`s of the text
    models it serves; config_class / encoder_class: the tower's; vision_fields: the
    vision_config fields its metadata gives beyond the shared ones; block_names / names:
    llama.cpp's tensor names (per block, `v.blk.i.<name>`; whole-file) -> the folder's,
    under PREFIX; min_pixels / max_pixels: the released preprocessor config's pixel budget;
    ffn_may_be_swapped: older exports of this type store ffn_up and ffn_down under each
    other's names (see `_swapped_ffn`).
    """

    family: str
    text_model_types: tuple[str, ...]
    config_class: type[VisionConfig] | type[Qwen3VisionConfig]
    encoder_class: type[Qwen2_5_VisionEncoder] | type[Qwen3_VisionEncoder]
    vision_fields: Callable[[GGUFFile], dict[str, Any]]
    block_names: dict[str, str]
    names: dict[str, str]
    min_pixels: int
    max_pixels: int
    ffn_may_be_swapped: bool = False


def _qwen2_5_fields(file: GGUFFile) -> dict[str, Any]:
    """Qwen2.5-VL's full-attention blocks: every n_wa_pattern-th (llama.cpp's rule,
    (i + 1) % n == 0; 0: no windows, every block full). llama.cpp requires the key for
    this projector type, and so does qinfer. The attention window is not read: llama.cpp
    ignores clip.vision.window_size for this type (112 pixels, fixed), so qinfer takes the
    same (`VisionConfig.window_size`)."""
    depth = _need(file, "clip.vision.block_count")
    pattern = _need(file, "clip.vision.n_wa_pattern")
    full = [i for i in range(depth) if not pattern or (i + 1) % pattern == 0]
    return {"fullatt_block_indexes": full, "hidden_act": "silu"}


def _qwen3_fields(file: GGUFFile) -> dict[str, Any]:
    """Qwen3-VL's position table (its rows, from the tensor) and DeepStack blocks."""
    table = _tensor(file, "v.position_embd.weight")
    stacked = file.metadata.get("clip.vision.is_deepstack_layers") or []
    return {
        "num_position_embeddings": table.weight_shape[0],
        "deepstack_visual_indexes": [i for i, on in enumerate(stacked) if on],
        "hidden_act": "gelu_pytorch_tanh",
    }


_BLOCK = {"attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2"}

PROJECTORS: dict[str, Projector] = {
    "qwen2.5vl_merger": Projector(
        family="Qwen2.5-VL",
        text_model_types=("qwen2_5_vl_text",),
        config_class=VisionConfig,
        encoder_class=Qwen2_5_VisionEncoder,
        vision_fields=_qwen2_5_fields,
        block_names={
            **_BLOCK,
            "attn_q": "attn.q",
            "attn_k": "attn.k",
            "attn_v": "attn.v",
            "ffn_gate": "mlp.gate_proj",
            "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj",
        },
        names={"v.post_ln": "merger.ln_q", "mm.0": "merger.mlp.0", "mm.2": "merger.mlp.2"},
        min_pixels=3136,
        max_pixels=12845056,
        ffn_may_be_swapped=True,
    ),
    "qwen3vl_merger": Projector(
        family="Qwen3-VL / Qwen3.5",  # Qwen3.5's tower: Qwen3-VL's without DeepStack
        text_model_types=("qwen3_vl_text", "qwen3_5_text", "qwen3_5_moe_text"),
        config_class=Qwen3VisionConfig,
        encoder_class=Qwen3_VisionEncoder,
        vision_fields=_qwen3_fields,
        block_names={
            **_BLOCK,
            "attn_qkv": "attn.qkv",
            "ffn_up": "mlp.linear_fc1",
            "ffn_down": "mlp.linear_fc2",
        },
        names={
            "v.post_ln": "merger.norm",
            "mm.0": "merger.linear_fc1",
            "mm.2": "merger.linear_fc2",
            "v.patch_embd": "patch_embed.proj",  # its bias; the kernel is PATCH_FRAMES
            "v.position_embd": "pos_embed",
        },
        min_pixels=65536,
        max_pixels=16777216,
    ),
}

#: A DeepStack merger's tensors (`v.deepstack.L.<part>`) -> the folder's, after block L.
DEEPSTACK_NAMES = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}
BLOCK_TENSOR = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)")
DEEPSTACK_TENSOR = re.compile(r"v\.deepstack\.(\d+)\.(\w+)\.(weight|bias)")
FILE_TENSOR = re.compile(r"(.+)\.(weight|bias)")


def load_projector(
    mmproj: str | Path,
    model_path: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    keep_blocks: bool = False,
    features: Features | None = None,
) -> tuple[Qwen2_5_VisionEncoder | Qwen3_VisionEncoder, ImageSettings]:
    """The vision tower (in `dtype` on `device`) and image settings of the projector file
    `mmproj`, for the text model `config` loaded from the GGUF file `model_path`.

    keep_blocks: keep its quantized blocks as the text model keeps its own (see
    `weights.gguf.open_gguf`); otherwise every tensor is dequantized. features: the text
    model's, whose arithmetic the kept blocks follow (`weights.load.load`). One ConfigError names
    the file and what is wrong: not a projector file, a projector type qinfer does not
    read, a model that is not that projector's text model (or not a GGUF file), a
    projection width other than the text model's hidden size, DeepStack counts that differ.
    """
    mmproj, model_path = Path(mmproj), Path(model_path)
    file, projector = check_projector(mmproj, model_path, config)
    fields = {
        "depth": _need(file, "clip.vision.block_count"),
        "hidden_size": _need(file, "clip.vision.embedding_length"),
        "intermediate_size": _need(file, "clip.vision.feed_forward_length"),
        "num_heads": _need(file, "clip.vision.attention.head_count"),
        "out_hidden_size": _need(file, "clip.vision.projection_dim"),
        "patch_size": _need(file, "clip.vision.patch_size"),
        "spatial_merge_size": file.metadata.get("clip.vision.spatial_merge_size") or 2,
        **projector.vision_fields(file),
    }
    mean, std = _need(file, "clip.vision.image_mean"), _need(file, "clip.vision.image_std")
    try:
        vision = projector.config_class.from_hf({"vision_config": fields})
        settings = ImageSettings.from_hf(
            {
                "min_pixels": projector.min_pixels,
                "max_pixels": projector.max_pixels,
                "patch_size": vision.patch_size,
                "merge_size": vision.spatial_merge_size,
                "temporal_patch_size": len(PATCH_FRAMES),
                "image_mean": mean,
                "image_std": std,
            }
        )
    except ConfigError as e:  # a value read from this file, named as the file names it
        raise ConfigError(f"{mmproj}: {CONFIG_FIELD.sub(_file_key, str(e))}") from None
    # on CUDA kept blocks compute in bfloat16 only (as `loading.load_model` says of a text
    # model's); a text model there in another dtype has its tower dequantized
    keep = keep_blocks and (torch.device(device).type != "cuda" or dtype == torch.bfloat16)
    weights = ProjectorWeights(
        file, _tensors(file, projector, vision), dtype, device, KEPT_TYPES if keep else ()
    )
    if "attn_qkv" in projector.block_names:
        split_qkv(weights, PREFIX, vision.depth, vision.hidden_size)
    return load(projector.encoder_class(vision, PREFIX), weights, features=features), settings


def check_projector(
    mmproj: str | Path, model_path: str | Path, config: ModelConfig | None = None
) -> tuple[GGUFFile, Projector]:
    """The projector file `mmproj`'s header and type, once checked against the GGUF text
    model `model_path` (its `config`, or None: read from its header), from the two files'
    headers alone: run before the text model loads, a wrong --mmproj fails in a moment.
    Refusals as `load_projector`'s."""
    mmproj, model_path = Path(mmproj), Path(model_path)
    file = read_gguf(mmproj)
    projector = _projector(file, mmproj)
    if model_path.suffix != ".gguf" or not model_path.is_file():
        raise ConfigError(
            f"--mmproj {mmproj} goes with a GGUF text model; {model_path} is not a .gguf file "
            "(a checkpoint folder brings its own vision tower)"
        )
    text = read_gguf(model_path)
    if config is None:
        config = config_from_gguf(text, model_path)
    _check_pair(file, projector, mmproj, model_path, config, text.metadata)
    return file, projector


def _projector(file: GGUFFile, path: Path) -> Projector:
    """The file's projector type, which qinfer must read."""
    arch = file.metadata.get("general.architecture")
    if arch != "clip":
        raise ConfigError(
            f"{path} is not a projector (mmproj) file: its general.architecture is {arch!r}, "
            "not 'clip'"
        )
    kind = file.metadata.get("clip.projector_type") or file.metadata.get(
        "clip.vision.projector_type"
    )
    if kind not in PROJECTORS:
        raise ConfigError(
            f"{path}: projector type {kind!r} is not supported; supported: {', '.join(PROJECTORS)}"
        )
    return PROJECTORS[kind]


def _check_pair(
    file: GGUFFile,
    projector: Projector,
    path: Path,
    model_path: Path,
    config: ModelConfig,
    text: dict[str, Any],
) -> None:
    """The projector serves this text model (its config; `text`: its file's metadata): its
    family, its hidden size, and (Qwen3-VL) as many DeepStack features as it adds."""
    if config.image_token_id is None:
        raise ConfigError(
            f"--mmproj {path} gives images to a vision-language model, but {model_path} is "
            f"a text-only model (model_type {config.model_type!r})"
        )
    if config.model_type not in projector.text_model_types:
        raise ConfigError(
            f"{path} is a {projector.family} projector; {model_path} is not a "
            f"{projector.family} text model (model_type {config.model_type!r})"
        )
    width = _need(file, "clip.vision.projection_dim")
    if width != config.hidden_size:
        raise ConfigError(
            f"{path}: clip.vision.projection_dim is {width}, but the text model {model_path} "
            f"has hidden size {config.hidden_size}"
        )
    arch = text.get("general.architecture")
    stacked = sum(bool(on) for on in file.metadata.get("clip.vision.is_deepstack_layers") or [])
    added = int(text.get(f"{arch}.n_deepstack_layers") or 0)
    if stacked != added:
        raise ConfigError(
            f"{path} gives {stacked} DeepStack features, but the text model {model_path} "
            f"adds {added} ({arch}.n_deepstack_layers)"
        )


def _tensors(
    file: GGUFFile, projector: Projector, vision: VisionConfig | Qwen3VisionConfig
) -> dict[str, TensorInfo]:
    """The file's tensors under the folder's names (PATCH_EMBED: its first frame, the second
    under `PATCH_EMBED.1`); the ones the tower does not read are left out."""
    stacked = getattr(vision, "deepstack_visual_indexes", ())
    swapped = _swapped_ffn(file, projector, vision)
    tensors = {}
    for stored in file.tensors:
        name = stored.name
        if name in PATCH_FRAMES:
            ours = PATCH_EMBED + name.removeprefix(PATCH_FRAMES[0])
        elif match := BLOCK_TENSOR.fullmatch(name):
            block, kind, suffix = match.groups()
            if kind not in projector.block_names:
                continue
            if block in swapped:
                kind = SWAPPED_FFN.get(kind, kind)
            ours = f"{PREFIX}.blocks.{block}.{projector.block_names[kind]}.{suffix}"
        elif match := DEEPSTACK_TENSOR.fullmatch(name):
            block, kind, suffix = match.groups()
            if int(block) not in stacked or kind not in DEEPSTACK_NAMES:
                continue
            merger = stacked.index(int(block))
            ours = f"{PREFIX}.deepstack_merger_list.{merger}.{DEEPSTACK_NAMES[kind]}.{suffix}"
        elif (match := FILE_TENSOR.fullmatch(name)) and match.group(1) in projector.names:
            ours = f"{PREFIX}.{projector.names[match.group(1)]}.{match.group(2)}"
        else:
            continue
        tensors[ours] = stored
    return tensors


#: The file's keys for the config fields they become (a config's refusal names its field).
FILE_KEYS = {
    "depth": "GGUF metadata clip.vision.block_count",
    "hidden_size": "GGUF metadata clip.vision.embedding_length",
    "intermediate_size": "GGUF metadata clip.vision.feed_forward_length",
    "num_heads": "GGUF metadata clip.vision.attention.head_count",
    "out_hidden_size": "GGUF metadata clip.vision.projection_dim",
    "patch_size": "GGUF metadata clip.vision.patch_size",
    "spatial_merge_size": "GGUF metadata clip.vision.spatial_merge_size",
    "merge_size": "GGUF metadata clip.vision.spatial_merge_size",
    "fullatt_block_indexes": "GGUF metadata clip.vision.n_wa_pattern",
    "deepstack_visual_indexes": "GGUF metadata clip.vision.is_deepstack_layers",
    "num_position_embeddings": "the rows of tensor v.position_embd.weight",
    "image_mean": "GGUF metadata clip.vision.image_mean",
    "image_std": "GGUF metadata clip.vision.image_std",
}
#: A config's name of a field in its refusals (`config field 'vision_config.x'`,
#: `preprocessor config field 'x'`).
CONFIG_FIELD = re.compile(r"(?:preprocessor )?config field '(?:vision_config\.)?(\w+)'")


def _file_key(match: re.Match[str]) -> str:
    """What the file calls a config field (FILE_KEYS); a default it does not store keeps the
    config's name."""
    return FILE_KEYS.get(match.group(1), match.group(0))


SWAPPED_FFN = {"ffn_up": "ffn_down", "ffn_down": "ffn_up"}


def _swapped_ffn(
    file: GGUFFile, projector: Projector, vision: VisionConfig | Qwen3VisionConfig
) -> set[str]:
    """The blocks (their numbers, as in the names) whose ffn_up and ffn_down, weights and
    biases, are stored under each other's names: llama.cpp's rule for older exports of some
    projector types, a ffn_down that takes the tower's width (hidden_size columns) where it
    takes the MLP's (intermediate_size). An MLP as wide as the tower cannot tell; it is read
    as named (llama.cpp would swap it)."""
    if not projector.ffn_may_be_swapped or vision.intermediate_size == vision.hidden_size:
        return set()
    swapped = set()
    for stored in file.tensors:
        match = BLOCK_TENSOR.fullmatch(stored.name)
        if match and match.group(2, 3) == ("ffn_down", "weight"):
            if stored.weight_shape[-1] == vision.hidden_size:
                swapped.add(match.group(1))
    return swapped


class ProjectorWeights(GGUFWeights):
    """A projector file's tensors; the patch embedding's two frames read as the Conv3d
    kernel (hidden, C, 2, P, P) they were split from, whole (a slice of it is refused)."""

    def _shape(self, name: str) -> tuple[int, ...]:
        shape = super()._shape(name)
        if name != PATCH_EMBED:
            return shape
        if not self.has(f"{PATCH_EMBED}.1"):
            raise WeightsError(f"{self.path} has no tensor {PATCH_FRAMES[1]!r}")
        return (shape[0], shape[1], len(PATCH_FRAMES), *shape[2:])

    def _read(self, name: str, rows: slice = ALL, columns: slice = ALL) -> torch.Tensor:
        if name != PATCH_EMBED:
            return super()._read(name, rows, columns)
        if rows != ALL or columns != ALL:  # the kernel is stacked from two whole tensors
            raise WeightsError(f"{self.path}: {PATCH_EMBED} is read whole, not in slices")
        frames = [super(ProjectorWeights, self)._read(n) for n in (name, f"{name}.1")]
        return torch.stack(frames, dim=2)  # (hidden, C, P, P) x 2 -> (hidden, C, 2, P, P)


def _need(file: GGUFFile, key: str) -> Any:
    value = file.metadata.get(key)
    if value is None:
        raise ConfigError(f"{file.path}: GGUF metadata {key} is missing")
    return value


def _tensor(file: GGUFFile, name: str) -> TensorInfo:
    stored = file.tensor(name)
    if stored is None:
        raise ConfigError(f"{file.path} has no tensor {name!r}")
    return stored

"""What a family's file provides, and the config reading every family shares.

A family (`Family`) says which Hugging Face `model_type`s and GGUF architectures it reads,
turns a config.json dict into a `ModelConfig` (`read_config`), and may add what its GGUF
files say differently from llama.cpp's shared metadata (`gguf_fields`), name their tensors
otherwise (`gguf_layer_names`), or fuse tensors the loader reads apart (`fused_tensors`).

`HFConfig` reads a config.json dict with errors that name the field; `shared_fields` reads
the fields every family has (shapes, context, RoPE, tokens), so a family's adapter says
only what sets it apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from qinfer.core.errors import ConfigError
from qinfer.core.model_config import (
    ACTIVATIONS,
    FULL_ATTENTION,
    ROPE_TYPES,
    SLIDING_ATTENTION,
    ModelConfig,
    RopeConfig,
)

#: llama.cpp's per-layer tensor names (`blk.N.<name>`) -> ours (`model.layers.N.<name>`),
#: shared by the architectures that do not rename them.
GGUF_LAYER_NAMES: Mapping[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class FusedTensor:
    """A checkpoint tensor that stacks, by rows, several projections the loader reads by
    their own names: `parts` is (our name, rows) in order, names relative to a layer
    (`self_attn.qkv_proj` holding `self_attn.q_proj`, `.k_proj`, `.v_proj`)."""

    stored: str
    parts: tuple[tuple[str, int], ...]


class HFConfig:
    """A config.json dict read by field, every error naming the field at fault."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        self.model_type = values.get("model_type")

    def get(self, key: str, default: Any = None) -> Any:
        value = self.values.get(key)
        return default if value is None else value

    def number(self, key: str, default: int | float | None = None, kind: type = int) -> Any:
        """Field `key` as a positive number; a missing field without a default is an error."""
        value = self.values.get(key)
        if value is None:
            if default is None:
                raise ConfigError(f"config field {key!r} is missing (model_type {self.model_type})")
            return default
        try:
            parsed = kind(value)
        except (TypeError, ValueError):
            raise ConfigError(f"config field {key!r} must be a number, got {value!r}") from None
        if parsed <= 0:
            raise ConfigError(f"config field {key!r} must be positive, got {value!r}")
        return parsed

    def flag(self, key: str, default: bool = False) -> bool:
        return bool(self.values.get(key, default))

    def activation(self, key: str = "hidden_act") -> str:
        """The MLP gate's activation from field `key` (default SiLU), refused by that
        field's name when the shared MLP has no such activation."""
        activation = self.values.get(key) or "silu"
        if activation not in ACTIVATIONS:
            raise ConfigError(
                f"config field {key!r} is {activation!r}; supported: {', '.join(ACTIVATIONS)}"
            )
        return activation

    def layer_indices(self, key: str) -> list[int]:
        """Field `key` as a list of layer indices (absent: none)."""
        value = self.values.get(key) or []
        if not isinstance(value, list) or not all(isinstance(i, int) for i in value):
            raise ConfigError(
                f"config field {key!r} must be a list of layer indices, got {value!r}"
            )
        return value


def shared_fields(cfg: HFConfig, **overrides: Any) -> dict[str, Any]:
    """The ModelConfig fields every family reads the same way, with `overrides` (a family's
    sliding windows, RoPE or wiring) taking their place."""
    hidden = cfg.number("hidden_size")
    heads = cfg.number("num_attention_heads")
    layers = cfg.number("num_hidden_layers")
    eos = cfg.get("eos_token_id")
    fields = dict(
        model_type=cfg.model_type,
        vocab_size=cfg.number("vocab_size"),
        hidden_size=hidden,
        intermediate_size=cfg.number("intermediate_size"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=cfg.number("num_key_value_heads", heads),
        head_dim=cfg.number("head_dim", hidden // heads),
        rms_norm_eps=cfg.number("rms_norm_eps", 1e-6, float),
        max_position_embeddings=cfg.number("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.flag("tie_word_embeddings"),
        sliding_window=None,
        layer_types=(FULL_ATTENTION,) * layers,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
    )
    if "rope" not in overrides:  # a family that reads its RoPE otherwise is not second-guessed
        fields["rope"] = rope_config_from_hf(cfg.values)
    return {**fields, **overrides}


def rope_config_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    """Merge `rope_theta` + `rope_scaling` (old) or `rope_parameters` (new) into a RopeConfig.

    Both spellings transformers has written are read; `partial_rotary_factor` may sit at the
    top level (old) or among the RoPE parameters (new).
    """
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"config field {key!r} must be an object, got {value!r}")
        params.update(value)
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    if rope_type not in ("default", "longrope") and params.get("factor") is None:
        raise ConfigError(f"rope_type {rope_type!r} needs a 'factor'")
    original = params.get("original_max_position_embeddings")
    if rope_type == "llama3" and original is None:
        raise ConfigError("rope_type 'llama3' needs 'original_max_position_embeddings'")
    if rope_type in ("yarn", "longrope") and original is None:
        original = cfg.get("max_position_embeddings")
    optional = {
        k: float(params[k])
        for k in ("attention_factor", "mscale", "mscale_all_dim", "partial_rotary_factor")
        if params.get(k) is not None
    }
    if "partial_rotary_factor" not in optional and cfg.get("partial_rotary_factor") is not None:
        optional["partial_rotary_factor"] = float(cfg["partial_rotary_factor"])
    factor = params.get("factor")
    if rope_type == "longrope":
        optional |= _longrope_factors(params)
        if factor is None and original:  # transformers: the ratio of the two contexts
            factor = cfg.get("max_position_embeddings", original) / original
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=float(factor or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=None if original is None else int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        **optional,
    )


def _longrope_factors(params: dict[str, Any]) -> dict[str, tuple[float, ...]]:
    """LongRoPE's short_factor and long_factor, each a list of numbers."""
    found = {}
    for key in ("short_factor", "long_factor"):
        value = params.get(key)
        if not isinstance(value, list) or not all(isinstance(x, int | float) for x in value):
            raise ConfigError(f"rope_type 'longrope' needs {key!r}, a list of numbers")
        found[key] = tuple(float(x) for x in value)
    if len(found["short_factor"]) != len(found["long_factor"]):
        raise ConfigError("rope_type 'longrope': 'short_factor' and 'long_factor' differ in length")
    return found


def window_from(cfg: HFConfig, layers: int, first_sliding: int = 0) -> dict[str, Any]:
    """`sliding_window` and `layer_types` of a family whose layers from `first_sliding` up
    slide when a window is set; a `layer_types` list (recent transformers) wins, and means
    full attention everywhere when there is no window."""
    window = cfg.get("sliding_window")
    if window is None:
        return dict(sliding_window=None, layer_types=(FULL_ATTENTION,) * layers)
    explicit = cfg.get("layer_types")
    if explicit is not None:
        return dict(sliding_window=int(window), layer_types=tuple(explicit))
    kinds = tuple(
        SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(layers)
    )
    return dict(sliding_window=int(window), layer_types=kinds)


@dataclass(frozen=True)
class GGUFHeader:
    """What a family may read of a GGUF file: its metadata, tensor names, and small float
    tensors (RoPE factors). Keys are given without the `{arch}.` prefix."""

    arch: str
    metadata: Mapping[str, Any]
    tensor_names: frozenset[str]
    read_floats: Callable[[str], list[float]]

    def get(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(f"{self.arch}.{key}")
        return default if value is None else value

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ConfigError(f"GGUF metadata {self.arch}.{key} is missing")
        if isinstance(value, list):
            raise ConfigError(f"GGUF metadata {self.arch}.{key} is a per-layer list")
        return value


def _no_fields(header: GGUFHeader) -> dict[str, Any]:
    return {}


def _no_fused(config: ModelConfig) -> tuple[FusedTensor, ...]:
    return ()


@dataclass(frozen=True)
class Family:
    """One family's file, as the registry (`qinfer.models`) knows it.

    model_types: the config.json `model_type`s it reads (the first is what its configs say).
    read_config: config.json dict (wrapped) -> ModelConfig.
    gguf_architectures: `general.architecture` values of its GGUF files (none: no GGUF).
    gguf_fields: HF-style config fields its GGUF metadata (or llama.cpp's fixed rules) give
        beyond the shared ones `weights.gguf` reads.
    gguf_layer_names: llama.cpp's layer tensor names -> ours.
    gguf_qk_permuted: llama.cpp's converter permuted q/k rows for its interleaved RoPE.
    gguf_value_heads_tiled: the converter stored the Gated DeltaNet's value heads tiled
        (`weights.gguf_deltanet`).
    fused_tensors: tensors of its checkpoints that stack projections read apart.
    """

    name: str
    model_types: tuple[str, ...]
    read_config: Callable[[HFConfig], ModelConfig]
    gguf_architectures: tuple[str, ...] = ()
    gguf_fields: Callable[[GGUFHeader], dict[str, Any]] = _no_fields
    gguf_layer_names: Mapping[str, str] = field(default_factory=lambda: dict(GGUF_LAYER_NAMES))
    gguf_qk_permuted: bool = False
    gguf_value_heads_tiled: bool = False
    fused_tensors: Callable[[ModelConfig], tuple[FusedTensor, ...]] = _no_fused

"""SmolLM3: Llama's blocks, with some layers that have no RoPE (NoPE).

config.json: `no_rope_layers` holds one entry per layer, 1 where the layer rotates q and k
and 0 where it does not (the name says the opposite of its values, as in transformers);
without it, every `no_rope_layer_interval`-th layer (default 4) is a NoPE layer. With
`use_sliding_window` and no `layer_types`, the NoPE layers are the ones that slide.
GGUF (llama.cpp's "smollm3"): written as llama is (q/k rows permuted), with every fourth
layer NoPE, llama.cpp's constant.
"""

from __future__ import annotations

from typing import Any

from qinfer.core.errors import ConfigError
from qinfer.core.model_config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from qinfer.models.base import Family, GGUFHeader, HFConfig, shared_fields
from qinfer.models.llama import llama_wiring


def _uses_rope(cfg: HFConfig, layers: int) -> list[bool]:
    """Whether each layer rotates q and k."""
    given = cfg.get("no_rope_layers")
    if given is None:
        interval = cfg.number("no_rope_layer_interval", 4)
        return [(i + 1) % interval != 0 for i in range(layers)]
    if not isinstance(given, list) or len(given) != layers or not set(given) <= {0, 1}:
        raise ConfigError(
            f"config field 'no_rope_layers' must list 0 or 1 for each of the {layers} layers, "
            f"got {given!r}"
        )
    return [bool(uses) for uses in given]


def read_config(cfg: HFConfig) -> ModelConfig:
    """A SmolLM3 config.json -> ModelConfig."""
    layers = cfg.number("num_hidden_layers")
    uses_rope = _uses_rope(cfg, layers)
    window, explicit = cfg.get("sliding_window"), cfg.get("layer_types")
    if window is None:
        kinds = (FULL_ATTENTION,) * layers
    elif explicit is not None:
        kinds = tuple(explicit)
    elif cfg.flag("use_sliding_window"):
        kinds = tuple(FULL_ATTENTION if rope else SLIDING_ATTENTION for rope in uses_rope)
    else:
        kinds = (FULL_ATTENTION,) * layers
    no_rope = tuple(i for i, rope in enumerate(uses_rope) if not rope)
    return ModelConfig(
        **shared_fields(
            cfg,
            sliding_window=None if SLIDING_ATTENTION not in kinds else int(window),
            layer_types=kinds,
            wiring=llama_wiring(cfg, no_rope_layers=no_rope),
        )
    )


def gguf_fields(header: GGUFHeader) -> dict[str, Any]:
    """llama.cpp's fixed NoPE interval (its files say nothing of it)."""
    return {"no_rope_layer_interval": 4}  # llama.cpp's n_no_rope_layer_step


FAMILY = Family(
    name="SmolLM3",
    model_types=("smollm3",),
    read_config=read_config,
    gguf_architectures=("smollm3",),
    gguf_fields=gguf_fields,
    gguf_qk_permuted=True,
)

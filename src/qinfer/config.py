"""ModelConfig: one dataclass that describes every supported decoder-only family.

`ModelConfig.from_hf(dict)` reads a Hugging Face `config.json` for Qwen3, Qwen3-MoE,
Qwen2/2.5, Qwen2-MoE, Llama 3.x (and SmolLM2, which is Llama-shaped), Mistral and Gemma 3
(text). It accepts both spellings of RoPE settings that `transformers` has written over
the years:

- old: `rope_theta` + `rope_scaling: {"type" | "rope_type": ..., "factor": ...}`
- new (transformers >= 5): `rope_parameters: {"rope_type": ..., "rope_theta": ...}`, or
  one such dict per layer type (`{"full_attention": {...}, "sliding_attention": {...}}`)

What sets Gemma 3 apart is said by fields, never by its name in the model code: a RoPE
of its own for sliding-window layers (`sliding_rope`), `query_pre_attn_scalar`,
`embedding_scale`, norms that scale by (1 + weight) (`norm_weight_offset`), norms after
attention and MLP too (`sandwich_norms`), a GELU-gated MLP (`hidden_act`) and
`final_logit_softcapping`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qinfer.checkpoint import read_json_object
from qinfer.errors import ConfigError

SUPPORTED_MODEL_TYPES = (
    "qwen3",
    "qwen3_moe",
    "qwen2",
    "qwen2_moe",
    "llama",
    "mistral",
    "gemma3_text",
)
#: The mixture-of-experts families (their experts: `MoeConfig`).
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
#: The MLP's gate activations: SwiGLU's SiLU, and GeGLU's tanh-approximated GELU (Gemma).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

#: What `transformers` assumes for fields a Gemma 3 config.json may leave out
#: (Gemma3TextConfig's defaults; every sixth layer global when `layer_types` is absent).
GEMMA3_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "query_pre_attn_scalar": 256,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding settings; see `layers/rope.py` for how each type is used."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # llama3, yarn: the context length the model was pretrained with
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts feed-forward (Qwen3-MoE, Qwen2-MoE); see `layers/moe.py`.

    num_experts: experts per sparse layer, each a gated FFN (`hidden_act`) of
        `moe_intermediate_size`.
    num_experts_per_tok: how many the router picks for each token (top-k).
    norm_topk_prob: rescale the k picked probabilities to sum to 1 (else they keep the
        share of the softmax over all experts they had).
    sparse_layers: which layers have experts; the others have the dense MLP of
        `ModelConfig.intermediate_size` (`decoder_sparse_step`, `mlp_only_layers`).
    shared_expert_intermediate_size: Qwen2-MoE's shared expert, a gated FFN every token
        goes through, scaled by a sigmoid gate (0: none, as in Qwen3-MoE).
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]
    shared_expert_intermediate_size: int = 0


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and switches of a decoder-only transformer.

    `head_dim` is stored explicitly: it is not always hidden_size / num_attention_heads
    (Qwen3-0.6B: 16 heads x 128 = 2048 against hidden 1024).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    o_bias: bool = False  # Llama `attention_bias: true` also puts one on o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # The RoPE of sliding-window layers where it differs from `rope` (Gemma 3: theta 10k,
    # never scaled, while its global layers take theta 1M and any `rope_scaling`).
    sliding_rope: RopeConfig | None = None
    hidden_act: str = "silu"  # the MLP gate's activation (ACTIVATIONS)
    # Attention scores scale by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    query_pre_attn_scalar: float | None = None
    embedding_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    norm_weight_offset: float = 0.0  # Gemma: every RMSNorm scales by (offset + weight)
    sandwich_norms: bool = False  # Gemma: norms after attention and MLP too, four per block
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    torch_dtype: str | None = None
    moe: MoeConfig | None = None  # None: every layer's MLP is dense

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise ConfigError(f"layer_types holds unsupported kinds {sorted(unknown)}")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ConfigError("layer_types asks for sliding_attention but sliding_window is unset")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"hidden_act {self.hidden_act!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
            )

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s feed-forward is a mixture of experts."""
        return self.moe is not None and layer in self.moe.sparse_layers

    def window(self, layer: int) -> int | None:
        """The attention window of layer `layer` in tokens, or None for full attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    def rope_for(self, layer: int) -> RopeConfig:
        """The RoPE settings of layer `layer` (its own for sliding layers where they differ)."""
        if self.sliding_rope is not None and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_rope
        return self.rope

    @property
    def attention_scale(self) -> float:
        """What attention multiplies q . k by: 1/sqrt(query_pre_attn_scalar or head_dim)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read a `config.json` file (or the folder holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json found at {path}")
        return cls.from_hf(read_json_object(path, ConfigError))

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config dict; errors name the field at fault."""
        if not isinstance(cfg, dict):
            raise ConfigError("config must be a JSON object")
        model_type = cfg.get("model_type")
        if model_type == "gemma3":  # Gemma 3 with its vision tower: the text model alone
            text = cfg.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(
                    "config field 'text_config' (Gemma 3's text model) must be an object"
                )
            outer = {k: cfg[k] for k in ("dtype", "torch_dtype") if k in cfg}
            # transformers' Gemma3ForConditionalGeneration never softcaps its logits, whatever
            # its text_config says (null in Google's checkpoints).
            text = {**text, "final_logit_softcapping": None}
            return cls.from_hf({**outer, **text, "model_type": "gemma3_text"})
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        gemma = model_type == "gemma3_text"
        if gemma:
            cfg = {**GEMMA3_DEFAULTS, **cfg}
            if cfg.get("attn_logit_softcapping") is not None:
                raise ConfigError(
                    "config field 'attn_logit_softcapping' is set; qinfer's attention has no "
                    "score softcapping (Gemma 3 checkpoints leave it null)"
                )

        def number(key: str, default: int | float | None = None, kind: type = int) -> Any:
            """Field `key` as a positive number; a missing field without a default is an error."""
            value = cfg.get(key)
            if value is None:
                if default is None:
                    raise ConfigError(f"config field {key!r} is missing (model_type {model_type})")
                return default
            try:
                parsed = kind(value)
            except (TypeError, ValueError):
                raise ConfigError(f"config field {key!r} must be a number, got {value!r}") from None
            if parsed <= 0:
                raise ConfigError(f"config field {key!r} must be positive, got {value!r}")
            return parsed

        if gemma:  # read here, where a bad value is refused by name, before they are used
            cfg["sliding_window_pattern"] = number("sliding_window_pattern")
            cfg["rope_local_base_freq"] = number("rope_local_base_freq", kind=float)
        hidden = number("hidden_size")
        heads = number("num_attention_heads")
        kv_heads = number("num_key_value_heads", heads)
        head_dim = number("head_dim", hidden // heads)
        layers = number("num_hidden_layers")
        attention_bias = bool(cfg.get("attention_bias", False))
        sliding_window, layer_types = _sliding_window(cfg, model_type, layers)
        rope, sliding_rope = _layer_ropes(cfg) if gemma else (rope_config_from_hf(cfg), None)
        final_cap = cfg.get("final_logit_softcapping")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=number("vocab_size"),
            hidden_size=hidden,
            intermediate_size=number("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=number("rms_norm_eps", 1e-6, float),
            max_position_embeddings=number("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2's q/k/v always have a bias and its config has no switch for it
            # (Qwen2-MoE's has one, `qkv_bias`, true by default).
            qkv_bias={"qwen2": True, "qwen2_moe": bool(cfg.get("qkv_bias", True))}.get(
                model_type, attention_bias
            ),
            o_bias=False if model_type in ("qwen2", "qwen2_moe") else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            rope=rope,
            sliding_window=sliding_window,
            layer_types=layer_types,
            sliding_rope=sliding_rope,
            hidden_act=_activation(cfg),
            query_pre_attn_scalar=number("query_pre_attn_scalar", kind=float) if gemma else None,
            embedding_scale=hidden**0.5 if gemma else None,
            norm_weight_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            final_logit_softcapping=None if final_cap is None else float(final_cap),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_ids,
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            moe=moe_config_from_hf(cfg, layers, number) if model_type in MOE_MODEL_TYPES else None,
        )


def rope_config_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    """Merge `rope_theta` + `rope_scaling` (old) or `rope_parameters` (new) into a RopeConfig."""
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
    if rope_type != "default" and params.get("factor") is None:
        raise ConfigError(f"rope_type {rope_type!r} needs a 'factor'")
    original = params.get("original_max_position_embeddings")
    if rope_type == "llama3" and original is None:
        raise ConfigError("rope_type 'llama3' needs 'original_max_position_embeddings'")
    if rope_type == "yarn" and original is None:
        original = cfg.get("max_position_embeddings")
    optional = {
        k: float(params[k])
        for k in ("attention_factor", "mscale", "mscale_all_dim")
        if params.get(k) is not None
    }
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=float(params.get("factor") or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=None if original is None else int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        **optional,
    )


def moe_config_from_hf(cfg: dict[str, Any], layers: int, number: Callable) -> MoeConfig:
    """The experts of a `qwen3_moe` or `qwen2_moe` config. A layer i is sparse when it is not in
    `mlp_only_layers` and (i + 1) is a multiple of `decoder_sparse_step`, as in
    transformers; `num_experts` is also spelt `num_local_experts` (transformers 5 writes it
    so). number(key, default) reads a positive number, naming the field when it is not."""
    experts = number("num_experts", cfg.get("num_local_experts"))
    top_k = number("num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(
            f"config field 'num_experts_per_tok' ({top_k}) is more than num_experts ({experts})"
        )
    step = number("decoder_sparse_step", 1)
    shared_key = "shared_expert_intermediate_size"  # Qwen2-MoE; absent or 0: no shared expert
    shared = number(shared_key) if cfg.get(shared_key) else 0
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ConfigError(
            f"config field 'mlp_only_layers' must be a list of layer indices, got {dense!r}"
        )
    return MoeConfig(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=number("moe_intermediate_size"),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
        shared_expert_intermediate_size=shared,
    )


def _activation(cfg: dict[str, Any]) -> str:
    """The MLP gate's activation: Gemma's `hidden_activation`, else `hidden_act` (default
    SiLU), refused by the name of the field that holds it when not in ACTIVATIONS."""
    key = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
    activation = cfg.get(key) or "silu"
    if activation not in ACTIVATIONS:
        raise ConfigError(
            f"config field {key!r} is {activation!r}; supported: {', '.join(ACTIVATIONS)}"
        )
    return activation


def _layer_ropes(cfg: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(global, sliding) RoPE of a Gemma 3 config: `rope_parameters` keyed by layer type
    (transformers >= 5); a layer type it leaves out (or the old spelling) takes, as in
    transformers, `rope_theta` + `rope_scaling` for the global layers and
    `rope_local_base_freq` (never scaled) for the sliding ones."""
    local = {"rope_theta": cfg["rope_local_base_freq"], "rope_type": "default"}
    local_rope = rope_config_from_hf({"rope_parameters": local})
    by_type = cfg.get("rope_parameters")
    if not (isinstance(by_type, dict) and {FULL_ATTENTION, SLIDING_ATTENTION} & set(by_type)):
        return rope_config_from_hf(cfg), local_rope

    def given(params: dict[str, Any]) -> RopeConfig:
        return rope_config_from_hf({**cfg, "rope_scaling": None, "rope_parameters": params})

    full, sliding = by_type.get(FULL_ATTENTION), by_type.get(SLIDING_ATTENTION)
    return (
        given(full) if full else rope_config_from_hf({**cfg, "rope_parameters": None}),
        given(sliding) if sliding else local_rope,
    )


def _sliding_window(
    cfg: dict[str, Any], model_type: str, layers: int
) -> tuple[int | None, tuple[str, ...]]:
    """Which layers use a sliding window, and how wide it is.

    - `layer_types` (written by recent transformers) wins when present.
    - Mistral: `sliding_window` (int or null) applies to every layer.
    - Qwen2/Qwen3: only with `use_sliding_window`, and only for layers with index
      >= `max_window_layers`.
    - Llama: never.
    - Gemma 3: every `sliding_window_pattern`-th layer is global, the others slide.
    """
    window = cfg.get("sliding_window")
    qwen = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
    if model_type in qwen and not cfg.get("use_sliding_window", False):
        window = None
    if model_type == "llama":
        window = None
    explicit = cfg.get("layer_types")
    if explicit is not None:
        if window is None:  # a layer_types list without a window means full attention
            return None, (FULL_ATTENTION,) * layers
        return int(window), tuple(explicit)
    if window is None:
        return None, (FULL_ATTENTION,) * layers
    if model_type == "gemma3_text":
        pattern = int(cfg["sliding_window_pattern"])
        kinds = tuple(
            FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(layers)
        )
        return int(window), kinds
    first_sliding = int(cfg.get("max_window_layers", 0)) if model_type != "mistral" else 0
    kinds = tuple(
        SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(layers)
    )
    return int(window), kinds

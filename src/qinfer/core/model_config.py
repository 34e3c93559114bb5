"""ModelConfig: what every supported decoder-only family has, and how its file wired it.

The shapes (hidden size, heads, layers, vocabulary), the context, the RoPE, the attention
windows and the special tokens are fields of `ModelConfig`. How a family wires the shared
layers (biases, QK-norm, the MLP's activation, Gemma's norms and scales, layers without
RoPE, ...) is one `Wiring`, whose neutral defaults are Llama's. A mixture of experts is a
`MoeConfig`.

Which config.json keys (and GGUF metadata) mean what, for each family, lives in that
family's file under `qinfer.models`: `qinfer.models.config_from_hf(dict)` builds a
ModelConfig, and this module knows no family by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qinfer.core.errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
#: A Gated DeltaNet layer (Qwen3.5, Qwen3-Next): linear attention over a fixed-size state.
LINEAR_ATTENTION = "linear_attention"
LAYER_KINDS = (FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION)
#: The MLP's gate activations: SwiGLU's SiLU, and GeGLU's tanh-approximated GELU (Gemma).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding settings; see `rope_scaling.py` for how each type is used.

    partial_rotary_factor: the share of each head's dimensions that rotate (the first
    head_dim * factor; Phi-4-mini: 0.75); the others pass through unrotated.
    mrope_section: M-RoPE (Qwen2.5-VL, Qwen3-VL): how many of the rotary dims / 2
        frequencies follow each of a token's three positions (temporal, height, width);
        empty: one position. mrope_interleaved: the sections' frequencies alternate
        (Qwen3-VL: t, h, w, t, h, w, ...) instead of lying in three runs (Qwen2.5-VL).
    """

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # llama3, yarn, longrope: the context length the model was pretrained with
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # yarn, longrope: the scale on cos/sin (None: the type's default from `factor`)
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # longrope: per-frequency divisors of the inverse frequencies, (rotary dims / 2,) each
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    partial_rotary_factor: float = 1.0
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts feed-forward (Qwen3-MoE, Qwen2-MoE); see `layers/moe.py`.

    num_experts: experts per sparse layer, each a gated FFN (`Wiring.hidden_act`) of
        `moe_intermediate_size`.
    num_experts_per_tok: how many the router picks for each token (top-k).
    norm_topk_prob: rescale the k picked probabilities to sum to 1 (else they keep the
        share of the softmax over all experts they had).
    sparse_layers: which layers have experts; the others have the dense MLP of
        `ModelConfig.intermediate_size`.
    shared_expert_intermediate_size: Qwen2-MoE's shared expert, a gated FFN every token
        goes through, scaled by a sigmoid gate (0: none, as in Qwen3-MoE).
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]
    shared_expert_intermediate_size: int = 0


#: The Gated DeltaNet's input projections as Qwen3.5 stores them, and as Qwen3-Next does
#: (`DeltaNetConfig.projections`).
SPLIT_PROJECTIONS = ("qkv", "z", "b", "a")
GROUPED_PROJECTIONS = ("qkvz", "ba")


@dataclass(frozen=True)
class DeltaNetConfig:
    """The Gated DeltaNet layers of a hybrid model (Qwen3.5, Qwen3-Next); see
    `layers/gated_deltanet.py`.

    num_key_heads, key_head_dim: q and k heads (each value head reads key head
        h // (num_value_heads / num_key_heads)); num_value_heads, value_head_dim: v, z and
        the recurrent state's heads (Hv x d_k x d_v per sequence, fp32).
    conv_kernel: the causal depthwise conv1d's width over q/k/v (4): a sequence keeps its
        last conv_kernel - 1 inputs.
    projections: the checkpoint's input projections (`in_proj_<part>`), in the order the
        layer fuses them: Qwen3.5's `qkv`, `z`, `b`, `a`, each in head order (SPLIT);
        Qwen3-Next's `qkvz`, `ba`, whose rows are grouped by key head (q, k, v, z of key
        head 0, then of key head 1, ...: GROUPED); llama.cpp's qwen3next files hold `qkv`
        and `z` split, `ba` grouped.
    """

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    projections: tuple[str, ...] = SPLIT_PROJECTIONS

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ConfigError(
                f"config field 'linear_num_value_heads' ({self.num_value_heads}) must be a "
                f"multiple of linear_num_key_heads ({self.num_key_heads})"
            )

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """The conv's channels: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class Wiring:
    """How a family wires the shared layers; a family's file (`qinfer.models`) sets what
    differs from these defaults (Llama's)."""

    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    o_bias: bool = False  # so does o_proj (Llama's `attention_bias: true`)
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # the MLP gate's activation (ACTIVATIONS)
    # What attention multiplies q . k by (None: head_dim ** -0.5).
    attention_scale: float | None = None
    # The RoPE of sliding-window layers where it differs from `ModelConfig.rope` (Gemma 3).
    sliding_rope: RopeConfig | None = None
    no_rope_layers: tuple[int, ...] = ()  # layers whose attention has no RoPE (SmolLM3)
    embedding_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden))
    norm_weight_offset: float = 0.0  # every RMSNorm scales by (offset + weight) (Gemma: 1)
    # Norms after attention and MLP too, four per block, named as Gemma's checkpoints do.
    sandwich_norms: bool = False
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    # Attention's output gated per channel by sigmoid(gate) before o_proj (Qwen3.5,
    # Qwen3-Next): q_proj is twice as wide, each head's query then its gate.
    attention_output_gate: bool = False

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"hidden_act {self.hidden_act!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and settings of a decoder-only transformer.

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
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    torch_dtype: str | None = None
    wiring: Wiring = field(default_factory=Wiring)
    moe: MoeConfig | None = None  # None: every layer's MLP is dense
    # The token whose rows images' embeddings replace (Qwen-VL's <|image_pad|>); None: a
    # text-only model, which refuses images.
    image_token_id: int | None = None
    # The Gated DeltaNet layers' shapes; None: no layer is linear attention.
    deltanet: DeltaNetConfig | None = None

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
        unknown = sorted(set(self.layer_types) - set(LAYER_KINDS))
        if unknown:
            raise ConfigError(
                f"config field 'layer_types' names unknown kinds {unknown}; "
                f"supported: {', '.join(LAYER_KINDS)}"
            )
        if LINEAR_ATTENTION in self.layer_types and self.deltanet is None:
            raise ConfigError(
                "config field 'layer_types' asks for linear_attention, which model_type "
                f"{self.model_type!r} does not have"
            )
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ConfigError("layer_types asks for sliding_attention but sliding_window is unset")
        for rope in (self.rope, self.wiring.sliding_rope):
            if rope is not None:
                _check_rope(rope, self.head_dim)

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s feed-forward is a mixture of experts."""
        return self.moe is not None and layer in self.moe.sparse_layers

    def linear(self, layer: int) -> bool:
        """Whether layer `layer` is a Gated DeltaNet (linear attention) layer."""
        return self.layer_types[layer] == LINEAR_ATTENTION

    def window(self, layer: int) -> int | None:
        """The attention window of layer `layer` in tokens, or None for full attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    def rope_for(self, layer: int) -> RopeConfig | None:
        """The RoPE settings of layer `layer` (its own for sliding layers where they differ),
        or None where the layer has no RoPE."""
        if layer in self.wiring.no_rope_layers:
            return None
        sliding = self.wiring.sliding_rope
        if sliding is not None and self.layer_types[layer] == SLIDING_ATTENTION:
            return sliding
        return self.rope

    @property
    def attention_scale(self) -> float:
        """What attention multiplies q . k by: the wiring's, else 1/sqrt(head_dim)."""
        scale = self.wiring.attention_scale
        return self.head_dim**-0.5 if scale is None else scale


def rope_dims(head_dim: int, rope: RopeConfig) -> int:
    """How many of a head's `head_dim` dimensions RoPE rotates (the first ones); rounded to
    6 places first, so that a factor written as rotary / head_dim gives back rotary."""
    return int(round(head_dim * rope.partial_rotary_factor, 6))


def _check_rope(rope: RopeConfig, head_dim: int) -> None:
    """Settings the RoPE layer cannot follow, refused by the field at fault."""
    rotary = rope_dims(head_dim, rope)
    if not 0 < rope.partial_rotary_factor <= 1 or rotary % 2:
        raise ConfigError(
            f"partial_rotary_factor {rope.partial_rotary_factor} must rotate an even number "
            f"of the {head_dim} dimensions of a head, got {rotary}"
        )
    if rope.mrope_section and (
        len(rope.mrope_section) != 3
        or min(rope.mrope_section) < 0
        or sum(rope.mrope_section) != rotary // 2
    ):
        raise ConfigError(
            f"mrope_section {list(rope.mrope_section)} must be 3 sizes adding up to the "
            f"{rotary // 2} rotary frequencies of a head (rotary dims / 2)"
        )
    if rope.type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(getattr(rope, key)) != rotary // 2:
                raise ConfigError(
                    f"rope_type 'longrope': {key!r} has {len(getattr(rope, key))} entries, "
                    f"expected {rotary // 2} (rotary dims / 2)"
                )

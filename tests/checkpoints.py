"""Random-weight checkpoints built with `transformers`, the numerical oracle of the tests."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

import qinfer
from qinfer import kernels
from qinfer.core.model_config import ModelConfig
from qinfer.linear import Int4BlockLinear, Int4Linear
from qinfer.models import config_from_hf


def int4_kind() -> type:
    """The Linear that int4 groups of 32 become on this CPU (`qinfer.linear.build`): qinfer's
    exact kernel's where it builds, torch's int4 kernel's elsewhere."""
    return Int4BlockLinear if kernels.available() is None else Int4Linear


TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

#: A small Qwen3-MoE: top-2 of 8 experts; layer 1 has a dense MLP (mlp_only_layers).
QWEN3_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    head_dim=16,
    num_hidden_layers=3,
    mlp_only_layers=[1],
)

#: A small Qwen2-MoE: the same experts, plus the shared expert every token goes through.
QWEN2_MOE = dict(QWEN3_MOE, shared_expert_intermediate_size=64)

#: A small Qwen3.5: 4 layers, linear attention (Gated DeltaNet) then full attention, twice;
#: 2 key heads serving 4 value heads; gated attention with head_dim 32, a quarter of each
#: head rotated, in interleaved M-RoPE sections.
QWEN3_5 = dict(
    num_hidden_layers=4,
    head_dim=32,
    layer_types=["linear_attention", "full_attention"] * 2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        mrope_section=[2, 1, 1],
        mrope_interleaved=True,
    ),
)

#: Qwen3.5-MoE and Qwen3-Next: the same hybrid layers (no M-RoPE sections), top-2 of 8
#: experts and a shared expert in every layer.
QWEN3_5_MOE = dict(
    {k: v for k, v in QWEN3_5.items() if k != "rope_parameters"},
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)

#: The hybrid families and the shapes their tests build.
HYBRID = {
    "qwen3_5": QWEN3_5,
    "qwen3_5_moe": QWEN3_5_MOE,
    "qwen3_next": QWEN3_5_MOE,
}

#: A Gemma 3 shape: two sliding layers (window 6, RoPE theta 10k) then a global one (theta
#: 1M with linear scaling), query_pre_attn_scalar != head_dim, and a final softcap small
#: enough to bite on logits of order 1.
GEMMA3 = dict(
    head_dim=16,
    query_pre_attn_scalar=24,
    num_hidden_layers=3,
    sliding_window=6,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
    },
    final_logit_softcapping=3.0,
)

#: A SmolLM3 shape: layer 1 of 3 has no RoPE (no_rope_layer_interval 2) and, with
#: use_sliding_window, is the one that slides (window 6).
SMOLLM3 = dict(
    num_hidden_layers=3, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=6
)


def phi3_longrope(original: int, partial_rotary_factor: float = 0.75, head_dim: int = 16) -> dict:
    """Config overrides for a Phi-3 with LongRoPE of an original context of `original`
    positions (its short and long factors distinct per frequency) and partial rotary."""
    pairs = int(head_dim * partial_rotary_factor) // 2
    return dict(
        partial_rotary_factor=partial_rotary_factor,
        original_max_position_embeddings=original,
        rope_scaling=dict(
            rope_type="longrope",
            short_factor=[1.0 + 0.1 * i for i in range(pairs)],
            long_factor=[2.0 + 1.5 * i for i in range(pairs)],
        ),
    )


#: The smallest SigLIP vision tower a multimodal Gemma 3 can hold.
TINY_SIGLIP = dict(
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)

#: Families the cache and batch tests run on: full attention with GQA and QK-norm, a
#: sliding window on every layer, a window only on the upper layers, experts, and Gemma 3's
#: interleaved local/global layers with their two RoPE bases.
WINDOWED = {
    "qwen3": ("qwen3", dict(head_dim=32)),
    "mistral-window": ("mistral", dict(sliding_window=8)),
    "qwen2-window": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1, num_hidden_layers=3),
    ),
    "qwen3-moe": ("qwen3_moe", QWEN3_MOE),
    "gemma3": ("gemma3", GEMMA3),
    "smollm3": ("smollm3", SMOLLM3),
    # LongRoPE's short factors (a context no longer than the original: transformers' choice
    # at every length), partial rotary, a window on every layer; past the original context:
    # tests/test_families.py
    "phi3": ("phi3", dict(phi3_longrope(512), sliding_window=8)),
}


def llama3_rope(original_max_position_embeddings: int) -> dict:
    """Config overrides for Llama 3.1's RoPE scaling (factor 8, theta 500000) of a model
    first trained on `original_max_position_embeddings` positions."""
    scaling = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=original_max_position_embeddings,
    )
    return dict(rope_scaling=scaling, rope_theta=500000.0)


#: Config overrides for YaRN RoPE scaling, four times an original context of 128.
YARN_ROPE = dict(
    rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128)
)


#: Special token ids inside TINY's vocabulary where a family's defaults lie outside it.
SPECIAL_TOKENS = {
    "smollm3": dict(pad_token_id=None, bos_token_id=1, eos_token_id=2),
    "phi3": dict(pad_token_id=None, bos_token_id=1, eos_token_id=2),
}


def _hf_classes(family: str):
    """transformers' (config class, model class) of `family`."""
    import transformers

    return {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
        "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
    }[family]


def _hf_config(family: str, **overrides):
    """The transformers config `build_checkpoint` gives a text-only `family`."""
    config_class, _ = _hf_classes(family)
    return config_class(**{**TINY, **SPECIAL_TOKENS.get(family, {}), **overrides})


def tiny_config(family: str, **overrides) -> ModelConfig:
    """The qinfer config of the checkpoint `build_checkpoint(folder, family, **overrides)`
    would save, without building or saving a model."""
    return config_from_hf(_hf_config(family, **overrides).to_dict())


def random_model(family: str, seed: int = 0, **overrides) -> qinfer.Transformer:
    """A float32 CPU model of `tiny_config(family, **overrides)` with random weights, built
    in memory (`Transformer.random`): for tests that need a model, not parity with
    transformers."""
    return qinfer.Transformer.random(tiny_config(family, **overrides), seed=seed)


def build_checkpoint(folder: Path, family: str, seed: int = 0, **overrides):
    """Save a random `family` model (qwen3, qwen3_moe, qwen2, qwen2_moe, llama, mistral,
    gemma3, smollm3, phi3, qwen3_5, qwen3_5_moe, qwen3_next, or gemma3-vision: Gemma 3 with a tiny vision tower, `overrides` then shape its
    text model) to `folder`; return the HF model."""
    import transformers

    if family == "gemma3-vision":  # Gemma 3's text model inside its multimodal wrapper
        model_class = transformers.Gemma3ForConditionalGeneration
        config = transformers.Gemma3Config(
            text_config={**TINY, **overrides},
            vision_config=TINY_SIGLIP,
            mm_tokens_per_image=4,
            # image placeholder ids outside the vocabulary: text prompts never hold them
            image_token_index=1000,
            boi_token_index=1001,
            eoi_token_index=1002,
        )
    else:
        model_class = _hf_classes(family)[1]
        config = _hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    # Random init leaves norms at 1 and biases at 0: perturb every tensor so that each
    # weight actually matters to the comparison.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    # Weights of order 1: a DeltaNet's state then carries real signal (at gain 1 the
    # 4-layer model amplifies fp32 rounding past 1e-4 by layer 3: chaotic, not wrong).
    if family in HYBRID:
        spread_weights(model, gain=0.5)
    model.save_pretrained(folder)
    return model


def load_pair(folder: Path, family: str, **overrides):
    """(transformers model, qinfer model in float32 on CPU) of one random checkpoint."""
    reference = build_checkpoint(folder, family, **overrides)
    return reference, qinfer.load_model(folder, dtype=torch.float32, device="cpu")


def reference_logits(reference, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits (B, L, V) for tokens (B, L), no padding, no cache."""
    with torch.no_grad():
        return reference(tokens).logits.float()


def random_tokens(batch: int, length: int, seed: int = 1, vocab: int = 256) -> torch.Tensor:
    """(batch, length) random token ids, reproducible by seed."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def use_features(model, features) -> None:
    """Switch a loaded model's attention layers to other `qinfer.Features`."""
    model.features = features
    for layer in model.layers:
        layer.self_attn.features = features


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference of two tensors of the same shape."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


#: A model vocabulary large enough for `build_tokenizer`'s 261 ids.
CHAT_VOCAB_SIZE = 264

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def build_tokenizer(folder: Path, words: tuple[str, ...] = ()) -> None:
    """Save a tiny byte-level BPE tokenizer (one id per byte, no merges, ChatML special
    tokens, Qwen3's <think> tags, a ChatML chat template) to `folder`, so the text-level
    API can run on a random checkpoint built with vocab_size=CHAT_VOCAB_SIZE. words: whole
    words that get one token each after those (a reranker's "yes" and "no"; at most 3)."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 printable stand-ins for bytes
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer.add_tokens(
        [AddedToken("<think>", special=False), AddedToken("</think>", special=False)]
        + [AddedToken(word, special=False, single_word=True) for word in words]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "chat_template": CHATML_TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def build_chat_checkpoint(folder: Path, family: str, **overrides):
    """`build_checkpoint` with a vocabulary of CHAT_VOCAB_SIZE plus `build_tokenizer`'s
    tokenizer, for the text-level API; return the HF model."""
    reference = build_checkpoint(folder, family, vocab_size=CHAT_VOCAB_SIZE, **overrides)
    build_tokenizer(folder)
    return reference


def spread_weights(model: torch.nn.Module, gain: float = 1.0) -> None:
    """Weights of order gain/sqrt(fan_in), norm scales around 1, biases around 0: a random
    model whose outputs are of order 1, so that a parity tolerance means something."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator) * gain * p[0].numel() ** -0.5)
            elif "norm" in name or "ln_q" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=generator))


#: PEFT target_modules: the attention projections, and those with the MLP's.
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def save_lora_adapter(reference, folder, targets, r=8, alpha=16, rslora=False, seed=0, **save):
    """A random PEFT LoRA adapter (A and B non-zero) over a copy of `reference`, saved to
    `folder`; returns transformers + peft's model with the adapter merged in."""
    import peft

    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora)
    model = peft.get_peft_model(copy.deepcopy(reference), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    model.save_pretrained(folder, **save)
    return model.merge_and_unload().eval()

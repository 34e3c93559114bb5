"""The building blocks on their own: grouped attention, masks, RoPE, RMSNorm, ModelConfig."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from qinfer import kernels
from qinfer.attention.sdpa import (
    causal_blocks,
    causal_mask,
    scaled_dot_product_attention_grouped,
    torch_sdpa_grouped,
)
from qinfer.core.errors import ConfigError
from qinfer.core.model_config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeConfig
from qinfer.layers.norm import RMSNorm
from qinfer.layers.rope import RoPE, rope_frequencies
from qinfer.models import config_from_hf

# ---------------------------------------------------------------- grouped attention


def per_head_attention(q, k, v, scale, mask):
    """The textbook loop: query head h attends with KV head h // n_rep; mask (L, S) bool."""
    Hq, Hkv = q.shape[1], k.shape[1]
    n_rep = Hq // Hkv
    heads = []
    for h in range(Hq):
        scores = q[:, h] @ k[:, h // n_rep].transpose(-1, -2) * scale  # (B, L, S)
        scores = scores.masked_fill(~mask, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v[:, h // n_rep])
    return torch.stack(heads, dim=1)  # (B, Hq, L, D)


def qkv(B=2, Hq=6, Hkv=2, L=5, S=9, D=8, seed=0):
    """Random q (B, Hq, L, D) and k, v (B, Hkv, S, D) whose KV heads differ a lot, so that
    reading the wrong KV head for a query head changes the result."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g) * torch.arange(1, Hkv + 1)[None, :, None, None]
    v = torch.randn(B, Hkv, S, D, generator=g) + 10 * torch.arange(Hkv)[None, :, None, None]
    return q, k, v


def test_query_head_h_reads_kv_head_h_floordiv_n_rep():
    q, k, v = qkv()
    mask = causal_mask(5, 9)
    got = scaled_dot_product_attention_grouped(q, k, v, 0.3, "causal")
    want = per_head_attention(q, k, v, 0.3, mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The data tell the mappings apart: interleaved heads (h reads h % Hkv) give another result.
    interleaved = [h % 2 for h in range(6)]
    other = per_head_attention(q, k[:, interleaved], v[:, interleaved], 0.3, mask)
    assert not torch.allclose(got, other, atol=1e-2)


def test_causal_mask_is_bottom_right_when_queries_are_fewer_than_keys():
    # 3 new queries after 4 cached keys: query i is at position 4 + i and sees keys 0..4+i.
    want = torch.tensor(
        [
            [1, 1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(causal_mask(3, 7), want)


def test_causal_string_mask_means_bottom_right():
    q, k, v = qkv(L=3, S=7)
    got = scaled_dot_product_attention_grouped(q, k, v, 0.5, "causal")
    want = per_head_attention(q, k, v, 0.5, causal_mask(3, 7))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def random_bool_mask(B, H, L, S, seed=3):
    mask = torch.rand(B, H, L, S, generator=torch.Generator().manual_seed(seed)) > 0.4
    mask[..., 0] = True  # no query may see nothing
    return mask


@pytest.mark.parametrize(
    "L, S, mask",
    [
        pytest.param(9, 9, "causal", id="causal-L==S"),
        pytest.param(1, 9, "causal", id="causal-L==1"),
        pytest.param(4, 9, "causal", id="causal-1<L<S"),
        pytest.param(4, 9, None, id="no-mask"),
        pytest.param(4, 9, random_bool_mask(2, 1, 4, 9), id="bool-shared-heads"),
        pytest.param(4, 9, random_bool_mask(2, 6, 4, 9), id="bool-per-head"),
        pytest.param(1, 9, random_bool_mask(2, 1, 1, 9), id="bool-L==1"),
        pytest.param(1, 9, random_bool_mask(2, 6, 1, 9), id="bool-per-head-L==1"),
    ],
)
@pytest.mark.parametrize("Hkv", [1, 2, 6])
def test_fast_torch_sdpa_equals_the_reference(L, S, mask, Hkv):
    q, k, v = qkv(Hkv=Hkv, L=L, S=S)
    want = scaled_dot_product_attention_grouped(q, k, v, 0.35, mask)
    got = torch_sdpa_grouped(q, k, v, 0.35, mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("L", "S"), [(130, 130), (100, 160), (48, 48), (7, 200)])
def test_causal_blocks_equal_the_reference(L, S):
    """Query blocks of 48 (a short last one), each against the keys it may see, bottom-right
    aligned when S > L, grouped heads and two batch rows: the reference's result and the
    textbook loop's."""
    q, k, v = qkv(L=L, S=S, D=16)
    want = scaled_dot_product_attention_grouped(q, k, v, 0.35, "causal")
    got = causal_blocks(q, k, v, 0.35)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, per_head_attention(q, k, v, 0.35, causal_mask(L, S)))


@pytest.mark.parametrize("L, mask", [(1, None), (1, "bool"), (4, "causal"), (9, "causal")])
def test_fast_torch_sdpa_in_bfloat16_stays_close_to_the_fp32_reference(L, mask):
    # The fast path is handed the cache in the model's dtype (no fp32 copy per step); the
    # kernels must still accumulate in fp32, leaving only bf16's rounding of the output.
    q, k, v = qkv(L=L, S=9)
    if mask == "bool":
        mask = random_bool_mask(2, 1, L, 9)
    want = scaled_dot_product_attention_grouped(q, k, v, 0.35, mask)
    got = torch_sdpa_grouped(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.35, mask)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.02)


# ---------------------------------------------------------------- RoPE


def hf_config(rope_parameters, head_dim=64, max_position_embeddings=4096):
    return transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=rope_parameters,
    )


ROPES = {
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "dynamic": dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
    "llama3": dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=1024,
    ),
    "yarn": dict(
        rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=1024
    ),
    "yarn-mscale": dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=40.0,
        original_max_position_embeddings=512,
        mscale=1.0,
        mscale_all_dim=0.707,
        beta_fast=24,
        beta_slow=2,
    ),
}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_frequencies_match_transformers(name):
    hf = hf_config(dict(ROPES[name]))
    want_freq, want_scale = ROPE_INIT_FUNCTIONS[ROPES[name]["rope_type"]](hf, torch.device("cpu"))
    config = config_from_hf(hf.to_dict())
    got_freq, got_scale = rope_frequencies(config.head_dim, config.rope)
    torch.testing.assert_close(got_freq, want_freq, atol=0, rtol=1e-6)
    assert got_scale == pytest.approx(want_scale, rel=1e-6)


def test_default_rope_frequencies_match_transformers():
    hf = hf_config(dict(rope_type="default", rope_theta=123456.0))
    want, scale = _hf_default_rope(hf)
    config = config_from_hf(hf.to_dict())
    got, got_scale = rope_frequencies(config.head_dim, config.rope)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
    assert got_scale == scale == 1.0


def _hf_default_rope(hf):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding.compute_default_rope_parameters(hf)


def test_rope_rotates_pairs_of_halves_by_position_times_frequency():
    rope = RoPE(8, 64, 100.0)
    x = torch.randn(2, 5, 3, 8)
    got = rope(x, offset=7)
    inv_freq = 1.0 / 100.0 ** (torch.arange(0, 8, 2).float() / 8)
    angles = (torch.arange(7, 12).float()[:, None] * inv_freq)[None, :, None]  # (1, L, 1, 4)
    x1, x2 = x[..., :4], x[..., 4:]
    want = torch.cat(
        [x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()], -1
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rope_per_row_offsets_equal_separate_calls():
    rope = RoPE(16, 64, 10000.0)
    x = torch.randn(3, 4, 2, 16)
    got = rope(x, offset=torch.tensor([0, 5, 11]))
    for row, offset in enumerate([0, 5, 11]):
        torch.testing.assert_close(got[row : row + 1], rope(x[row : row + 1], offset=offset))


# ---------------------------------------------------------------- RMSNorm


def test_rms_norm_in_fp16_does_not_overflow_on_large_inputs():
    weight = torch.linspace(0.5, 1.5, 64)
    x = torch.full((2, 3, 64), 60000.0) * torch.linspace(-1, 1, 64)  # squares overflow fp16
    got = RMSNorm(64, weight.half(), 1e-6)(x.half())
    want = RMSNorm(64, weight, 1e-6)(x)
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)


def test_rms_norm_matches_transformers():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    reference = Qwen3RMSNorm(32, eps=1e-5)
    with torch.no_grad():
        reference.weight.normal_()
    x = torch.randn(4, 7, 32) * 3
    got = RMSNorm(32, reference.weight.detach(), 1e-5)(x)
    torch.testing.assert_close(got, reference(x).detach(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_scales_by_one_plus_weight_like_transformers(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    reference = Gemma3RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        reference.weight.normal_()
    x = (torch.randn(4, 7, 32) * 3).to(dtype)
    got = RMSNorm(32, reference.weight.detach().to(dtype), 1e-6, offset=1.0)(x)
    want = reference.to(dtype)(x).detach()
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_a_block_norm_on_the_fp32_stream_is_its_two_step_arithmetic(
    weight_dtype, offset, compiled, monkeypatch
):
    """`forward` on the fp32 residual against `normalize`'s fp32 statistics times the
    weight, rounded once to the matmul dtype (what decode calls 2x a layer). torch's path
    (CUDA, or no compiled kernels): F.rms_norm with the fp32 weight, the same bits. The
    CPU's compiled op (`qinfer.kernels.add_rms_norm`) sums the squares in its own order:
    within 2^-21 relative in fp32 (16 fp32 units of the scale), one bf16 unit (2^-7 relative
    at most) in bf16, as tests/test_rms_norm_kernel.py checks it against the same arithmetic."""
    if not compiled:
        monkeypatch.setattr(kernels, "in_use", lambda: False)
    elif kernels.available() is not None:
        pytest.skip(kernels.available())
    draws = torch.Generator().manual_seed(0)  # the same draws whatever ran before
    x = torch.randn(5, 576, generator=draws) * torch.logspace(-2, 2, 5)[:, None]  # any magnitude
    weight = torch.randn(576, generator=draws) * 0.1 + 1
    norm = RMSNorm(576, weight.to(weight_dtype), 1e-6, offset=offset)
    for out in (torch.float32, torch.bfloat16):
        norm.out_dtype = out
        expected = (F.rms_norm(x, (576,), eps=1e-6) * norm.weight.float()).to(out)
        if not compiled:
            assert torch.equal(norm(x), expected)
            continue
        rtol = 2.0**-21 if out == torch.float32 else 2.0**-7
        torch.testing.assert_close(norm(x).float(), expected.float(), rtol=rtol, atol=0)


# ---------------------------------------------------------------- ModelConfig

BASE = dict(
    model_type="llama",
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def config(**fields) -> ModelConfig:
    return config_from_hf({**BASE, **fields})


LLAMA3 = dict(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param(
            dict(rope_theta=5e5, rope_scaling=dict(type="llama3", **LLAMA3)), id="old-type"
        ),
        pytest.param(
            dict(rope_theta=5e5, rope_scaling=dict(rope_type="llama3", **LLAMA3)),
            id="old-rope_type",
        ),
        pytest.param(
            dict(rope_parameters=dict(rope_type="llama3", rope_theta=5e5, **LLAMA3)), id="new"
        ),
    ],
)
def test_config_reads_every_rope_spelling(fields):
    want = RopeConfig(
        theta=5e5,
        type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    assert config(**fields).rope == want


def test_config_rope_theta_alone_is_default_rope():
    assert config(rope_theta=1e6).rope == RopeConfig(theta=1e6)


def test_config_yarn_without_original_context_takes_max_position_embeddings():
    rope = config(max_position_embeddings=32768, rope_scaling=dict(type="yarn", factor=4.0)).rope
    assert rope.original_max_position_embeddings == 32768


def test_config_unsupported_rope_type_is_named():
    with pytest.raises(ConfigError, match="'ntk-by-parts'"):
        config(rope_scaling=dict(rope_type="ntk-by-parts", factor=2.0))


def test_config_head_dim_absent_is_hidden_over_heads():
    assert config().head_dim == 16


def test_config_head_dim_present_wins():
    assert config(head_dim=128).head_dim == 128


def test_config_qwen2_has_qkv_bias_but_no_o_bias():
    c = config(model_type="qwen2").wiring
    assert c.qkv_bias and not c.o_bias and not c.qk_norm


def test_config_qwen3_has_qk_norm():
    c = config(model_type="qwen3").wiring
    assert c.qk_norm and not c.qkv_bias


def test_config_mistral_sliding_window_applies_to_every_layer():
    c = config(model_type="mistral", sliding_window=4096)
    assert c.layer_types == (SLIDING_ATTENTION,) * 4
    assert [c.window(i) for i in range(4)] == [4096] * 4


def test_config_mistral_null_sliding_window_is_full_attention():
    c = config(model_type="mistral", sliding_window=None)
    assert c.layer_types == (FULL_ATTENTION,) * 4 and c.window(0) is None


def test_config_qwen2_sliding_window_needs_use_sliding_window():
    c = config(model_type="qwen2", sliding_window=4096, max_window_layers=2)
    assert c.layer_types == (FULL_ATTENTION,) * 4


def test_config_qwen2_windows_layers_from_max_window_layers_up():
    c = config(model_type="qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=2)
    assert c.layer_types == (FULL_ATTENTION,) * 2 + (SLIDING_ATTENTION,) * 2
    assert [c.window(i) for i in range(4)] == [None, None, 32, 32]


def test_config_layer_types_win():
    kinds = [SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION]
    c = config(model_type="qwen3", use_sliding_window=True, sliding_window=16, layer_types=kinds)
    assert c.layer_types == tuple(kinds)


def test_config_layer_types_without_window_is_full_attention():
    c = config(model_type="qwen3", layer_types=[FULL_ATTENTION] * 4)
    assert c.sliding_window is None and c.window(3) is None


def test_config_llama_never_slides():
    assert config(sliding_window=128).layer_types == (FULL_ATTENTION,) * 4


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "mistral"])
def test_config_agrees_with_transformers_layer_types(family):
    # transformers 5 computes layer_types itself; both must pick the same windowed layers.
    hf_class = {
        "qwen3": transformers.Qwen3Config,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }[family]
    hf = hf_class(
        **{k: v for k, v in BASE.items() if k != "model_type"},
        use_sliding_window=True,
        sliding_window=64,
        max_window_layers=1,
    )
    got = config_from_hf(hf.to_dict())
    want = getattr(hf, "layer_types", None) or [SLIDING_ATTENTION] * 4
    assert got.layer_types == tuple(want)


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("hidden_size", "wide", "must be a number"),
        ("num_attention_heads", 0, "must be positive"),
        ("rms_norm_eps", [1e-6], "must be a number"),
        ("vocab_size", None, "is missing"),
    ],
)
def test_config_bad_number_is_named(field, value, says):
    with pytest.raises(ConfigError) as excinfo:
        config(**{field: value})
    message = str(excinfo.value)
    assert repr(field) in message and says in message and "\n" not in message


def test_config_heads_not_a_multiple_of_kv_heads():
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        config(num_attention_heads=6, num_key_value_heads=4)


GEMMA3_TEXT = dict(BASE, model_type="gemma3_text", num_hidden_layers=13, head_dim=16)


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param(dict(), id="defaults"),
        pytest.param(
            dict(rope_theta=5e5, rope_local_base_freq=500.0, sliding_window=32), id="old-spelling"
        ),
        pytest.param(
            dict(rope_scaling=dict(rope_type="linear", factor=8.0), sliding_window_pattern=4),
            id="old-scaling-and-pattern",
        ),
        # a layer type left out of rope_parameters takes the old spelling's setting
        pytest.param(
            dict(rope_parameters={FULL_ATTENTION: dict(rope_type="default", rope_theta=2e5)}),
            id="only-full-rope-parameters",
        ),
        pytest.param(
            dict(
                rope_theta=5e5,
                rope_parameters={SLIDING_ATTENTION: dict(rope_type="default", rope_theta=1e3)},
            ),
            id="only-sliding-rope-parameters",
        ),
    ],
)
def test_config_gemma3_layers_and_ropes_agree_with_transformers(fields):
    # Old spellings: rope_theta + rope_scaling for the global layers, rope_local_base_freq
    # for the sliding ones, every sliding_window_pattern-th layer global.
    got = config_from_hf({**GEMMA3_TEXT, **fields})
    hf = transformers.Gemma3TextConfig(
        **{k: v for k, v in {**GEMMA3_TEXT, **fields}.items() if k != "model_type"}
    )
    assert got.layer_types == tuple(hf.layer_types)
    assert got.sliding_window == hf.sliding_window
    # transformers writes the per-layer-type spelling; both must give the same ropes.
    assert config_from_hf(hf.to_dict()) == got
    for kind, rope in ((FULL_ATTENTION, got.rope), (SLIDING_ATTENTION, got.wiring.sliding_rope)):
        params = hf.rope_parameters[kind]
        assert (rope.theta, rope.type) == (params["rope_theta"], params["rope_type"])
        assert rope.factor == params.get("factor", 1.0)
    assert got.attention_scale == 256**-0.5  # query_pre_attn_scalar's default
    assert got.wiring.embedding_scale == 64**0.5 and got.tie_word_embeddings


def test_config_gemma3_with_vision_is_its_text_config():
    text = {k: v for k, v in GEMMA3_TEXT.items() if k != "model_type"}
    outer = {"model_type": "gemma3", "text_config": text, "dtype": "bfloat16"}
    assert config_from_hf(outer) == config_from_hf({**GEMMA3_TEXT, "dtype": "bfloat16"})
    with pytest.raises(ConfigError, match="'text_config'"):
        config_from_hf({"model_type": "gemma3"})


def test_config_gemma3_attention_softcapping_is_refused_by_name():
    with pytest.raises(ConfigError, match="attn_logit_softcapping"):
        config_from_hf({**GEMMA3_TEXT, "attn_logit_softcapping": 50.0})


@pytest.mark.parametrize(
    "field, value",
    [
        ("hidden_activation", "gelu"),  # transformers' exact GELU: not Gemma's tanh one
        ("sliding_window_pattern", 0),
        ("sliding_window_pattern", "six"),
        ("rope_local_base_freq", "10k"),
    ],
)
def test_config_gemma3_bad_field_is_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=f"^config field '{field}'"):
        config_from_hf({**GEMMA3_TEXT, field: value})


def test_config_gemma3_attention_bias_reaches_q_k_v_and_o():
    # Gemma3Attention puts `attention_bias` on all four projections, as Llama does.
    wiring = config_from_hf({**GEMMA3_TEXT, "attention_bias": True}).wiring
    assert wiring.qkv_bias and wiring.o_bias
    assert not config_from_hf(GEMMA3_TEXT).wiring.qkv_bias

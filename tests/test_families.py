"""The families added as one file each under `qinfer.models`, against transformers in fp32:
SmolLM3 (layers without RoPE) and Phi-3 / Phi-4-mini (q/k/v and gate/up fused in the
checkpoint, LongRoPE, partial rotary), from safetensors and from GGUF; and the registry.

Cache invariance and batches of these families also run through `WINDOWED`
(tests/test_cache.py, tests/test_batch.py).
"""

import pytest
import torch
import transformers
from checkpoints import (
    SMOLLM3,
    build_checkpoint,
    load_pair,
    max_diff,
    phi3_longrope,
    random_tokens,
    reference_logits,
    tiny_config,
    use_features,
)
from gguf_files import write_gguf_model

import qinfer
from qinfer.core.errors import ConfigError
from qinfer.core.model_config import FULL_ATTENTION, SLIDING_ATTENTION
from qinfer.layers.rope import NoRoPE
from qinfer.models import config_from_hf

TOLERANCE = 2e-5  # fp32; logits are of order 1, as in tests/test_parity.py
LENGTH = 40  # tokens per row: past the LongRoPE cases' original context of 16

CASES = {
    # layer 1 of 3 without RoPE, and the one that slides
    "smollm3": ("smollm3", SMOLLM3),
    # every fourth layer NoPE (the default interval), GQA 4:1, no window
    "smollm3-interval-4": ("smollm3", dict(num_hidden_layers=5, num_key_value_heads=1)),
    # Phi-3-mini's shape: default RoPE over all of each head, q/k/v fused
    "phi3": ("phi3", dict(num_key_value_heads=4)),
    # Phi-4-mini's shape: partial rotary 0.75, GQA, tied embeddings, LongRoPE whose
    # original context (16) the 40 tokens pass: the long factors and the attention scale
    "phi4-mini-longrope": (
        "phi3",
        dict(phi3_longrope(16), num_key_value_heads=2, tie_word_embeddings=True),
    ),
    # LongRoPE on a context no longer than the original: the short factors
    "phi3-longrope-short": ("phi3", phi3_longrope(512, partial_rotary_factor=0.5)),
}


#: The cases a GGUF file can hold: llama.cpp's smollm3 fixes the NoPE interval at 4 and
#: has no window, so the "smollm3" case (interval 2, a window) has no GGUF form.
GGUF_CASES = {name: CASES[name][0] for name in CASES if name != "smollm3"}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    reference, model = load_pair(folder, family, **overrides)
    return request.param, reference, model


@pytest.fixture(scope="module")
def tokens():
    return random_tokens(2, LENGTH)


@pytest.mark.parametrize("fast_sdpa", [True, False])
def test_logits_match_transformers(case, tokens, fast_sdpa):
    _, reference, model = case
    use_features(model, qinfer.Features(fast_sdpa=fast_sdpa))
    assert max_diff(model(tokens), reference_logits(reference, tokens)) < TOLERANCE


def test_prefill_then_decode_equals_one_prefill(case, tokens):
    """Prefill 20 tokens (past LongRoPE's original 16), then decode the other 20 one by
    one: the logits of one forward over all 40."""
    _, reference, model = case
    cache = model.make_cache(2)
    pieces = [model(tokens[:, :20], cache=cache)]
    pieces += [model(tokens[:, i : i + 1], cache=cache) for i in range(20, LENGTH)]
    got = torch.cat(pieces, dim=1)
    assert max_diff(got, reference_logits(reference, tokens)) < TOLERANCE


def test_gguf_gives_transformers_logits(case, tokens, tmp_path):
    """llama.cpp's layout (smollm3: q/k permuted; phi3: attn_qkv and ffn_up fused, the
    rotary dims and LongRoPE factors as metadata and tensors), against the same model."""
    name, reference, _ = case
    if name not in GGUF_CASES:
        pytest.skip("llama.cpp's smollm3 GGUF cannot hold this case (GGUF_CASES)")
    model = qinfer.load_model(
        write_gguf_model(reference, tmp_path / "m.gguf", GGUF_CASES[name]), device="cpu"
    )
    assert max_diff(model(tokens), reference_logits(reference, tokens)) < TOLERANCE


# ------------------------------------------------------------- what each layer does


def test_smollm3_layers_without_rope_pass_q_and_k_through():
    model = qinfer.Transformer(tiny_config("smollm3", **SMOLLM3))  # built: no weights needed
    kinds = [type(layer.self_attn.rope) for layer in model.layers]
    assert kinds[1] is NoRoPE and NoRoPE not in (kinds[0], kinds[2])
    assert model.config.layer_types == (FULL_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION)


def test_longrope_past_the_original_context_uses_the_long_factors():
    overrides = phi3_longrope(16)
    model = qinfer.Transformer(tiny_config("phi3", **overrides))
    rope = model.layers[0].self_attn.rope
    assert rope.rotary_dims == 12  # 0.75 of head_dim 16
    default = 1.0 / (10000.0 ** (torch.arange(0, 12, 2).float() / 12))
    long = torch.tensor(overrides["rope_scaling"]["long_factor"])
    torch.testing.assert_close(rope.frequencies.inv_freq, default / long)
    # transformers' attention factor for max 512 over original 16
    assert rope.frequencies.scale == pytest.approx(
        (1 + torch.log(torch.tensor(32.0)) / torch.log(torch.tensor(16.0))).sqrt().item()
    )


# ---------------------------------------------------------------------- configs


def test_smollm3_no_rope_layers_agree_with_transformers():
    hf = transformers.SmolLM3Config(num_hidden_layers=9, use_sliding_window=True, sliding_window=64)
    config = config_from_hf(hf.to_dict())
    assert config.wiring.no_rope_layers == tuple(
        i for i, r in enumerate(hf.no_rope_layers) if not r
    )
    assert config.layer_types == tuple(hf.layer_types)


def test_smollm3_bad_no_rope_layers_is_named():
    fields = transformers.SmolLM3Config(num_hidden_layers=4).to_dict()
    with pytest.raises(ConfigError, match="^config field 'no_rope_layers'"):
        config_from_hf({**fields, "no_rope_layers": [1, 0]})


@pytest.mark.parametrize("spelling", ["su", "yarn", "longrope"])
def test_phi3_reads_every_spelling_of_longrope(spelling):
    overrides = phi3_longrope(16)
    overrides["rope_scaling"] = {**overrides["rope_scaling"], "type": spelling}
    del overrides["rope_scaling"]["rope_type"]
    fields = dict(model_type="phi3", vocab_size=64, hidden_size=64, intermediate_size=128)
    fields |= dict(num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)
    rope = config_from_hf({**fields, **overrides}).rope
    assert (rope.type, rope.original_max_position_embeddings, rope.factor) == ("longrope", 16, 32.0)
    assert rope.partial_rotary_factor == 0.75 and len(rope.long_factor) == 6


def test_longrope_factors_of_the_wrong_length_are_refused():
    hf = transformers.Phi3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        **phi3_longrope(16),
    ).to_dict()
    for key in ("short_factor", "long_factor"):  # 12 rotary dims: 6 factors each
        hf["rope_parameters"][key] = [1.0] * 8
    with pytest.raises(ConfigError, match="'short_factor' has 8 entries, expected 6"):
        config_from_hf(hf)


def test_unknown_model_type_lists_the_registry():
    with pytest.raises(ConfigError) as excinfo:
        config_from_hf({"model_type": "gpt_neox"})
    message = str(excinfo.value)
    assert "'gpt_neox'" in message
    assert all(t in message for t in ("llama", "qwen3", "gemma3_text", "smollm3", "phi3"))


def test_a_fused_tensor_of_the_wrong_size_is_named(tmp_path):
    build_checkpoint(tmp_path, "phi3", num_key_value_heads=2)
    config = (
        (tmp_path / "config.json")
        .read_text()
        .replace('"num_key_value_heads": 2', '"num_key_value_heads": 4')
    )
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(
        qinfer.core.errors.WeightsError, match="qkv_proj.weight.*has 128 rows, expected 192"
    ):
        qinfer.load_model(tmp_path, dtype="float32", device="cpu")

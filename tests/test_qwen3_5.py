"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next (hybrid Gated DeltaNet + gated attention) from
folders: configs read as transformers reads them, fp32 logits equal to transformers' on
prompts longer than the DeltaNet's chunk, prefill then decode equal to one forward, and a
step of sequences of different lengths equal to each alone.

The delta rule's own forms: tests/test_deltanet.py.
"""

import itertools

import pytest
import torch
from checkpoints import HYBRID, load_pair, max_diff, random_model, random_tokens, reference_logits

from qinfer.attention.deltanet import CHUNK_SIZE
from qinfer.attention.state_pool import StatePool, StepStates
from qinfer.core.errors import ConfigError, QinferError
from qinfer.core.model_config import GROUPED_PROJECTIONS, LINEAR_ATTENTION, SPLIT_PROJECTIONS
from qinfer.layers.gated_deltanet import GatedDeltaNet
from qinfer.models import config_from_hf

TOLERANCE = 1e-4  # fp32; logits of order 1 to 10
PROMPT = CHUNK_SIZE + 36  # two chunks, the second ragged


@pytest.fixture(scope="module", params=sorted(HYBRID))
def pair(request, tmp_path_factory):
    family = request.param
    return load_pair(tmp_path_factory.mktemp(family), family, **HYBRID[family])


def test_config_reads_the_hybrid_fields(pair):
    """Layer kinds, DeltaNet shapes, gated attention, zero-centred norms, a quarter of each
    head rotated; experts with a renormalised top-k and a shared expert."""
    reference, model = pair
    config = model.config
    assert config.layer_types == tuple(reference.config.layer_types)
    assert (config.deltanet.num_key_heads, config.deltanet.num_value_heads) == (2, 4)
    grouped = config.model_type == "qwen3_next"
    assert config.deltanet.projections == (GROUPED_PROJECTIONS if grouped else SPLIT_PROJECTIONS)
    assert config.wiring.attention_output_gate and config.wiring.norm_weight_offset == 1.0
    assert config.rope.partial_rotary_factor == 0.25
    if config.moe is not None:
        assert config.moe.norm_topk_prob and config.moe.shared_expert_intermediate_size == 48
        assert config.moe.sparse_layers == (0, 1, 2, 3)


def test_logits_equal_transformers(pair):
    """fp32 logits of two rows of PROMPT tokens, past the chunk size."""
    reference, model = pair
    tokens = random_tokens(2, PROMPT)
    assert max_diff(model(tokens), reference_logits(reference, tokens)) < TOLERANCE


def test_prefill_then_decode_equals_one_forward(pair):
    """A prompt in two chunks, then tokens one at a time, over one cache (KV caches and the
    DeltaNet's state pool): the logits of one forward over them all."""
    _, model = pair
    tokens = random_tokens(2, PROMPT + 3)
    whole = model(tokens)
    cache = model.make_cache(2)
    split = PROMPT - 30  # past the first chunk, whatever CHUNK_SIZE is
    pieces = [model(tokens[:, :split], cache=cache), model(tokens[:, split:PROMPT], cache=cache)]
    pieces += [model(tokens[:, t : t + 1], cache=cache) for t in range(PROMPT, PROMPT + 3)]
    assert max_diff(torch.cat(pieces, dim=1), whole) < TOLERANCE


def test_mixed_lengths_in_one_step_equal_each_alone():
    """A DeltaNet layer over a step of three sequences (a prompt chunk, a decode token, a
    longer prompt), each in its own slot, gives each sequence's output alone."""
    model = random_model("qwen3_5", **HYBRID["qwen3_5"])
    layer = model.layers[0].linear_attn
    assert isinstance(layer, GatedDeltaNet)
    layer.chunk_size = 8
    lengths = [5, 1, 19]
    x = torch.randn(
        sum(lengths), model.config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    starts = [0, 5, 6, 25]
    pool = StatePool(model.config, 4)
    slots = torch.tensor([pool.allocate() for _ in lengths])
    together = layer(x, StepStates(pool, slots), starts)
    alone_pool = StatePool(model.config, 1)
    for s, (start, end) in enumerate(itertools.pairwise(starts)):
        alone_pool.reset(0)
        alone = layer(x[start:end], StepStates(alone_pool, torch.tensor([0])), [0, end - start])
        assert max_diff(together[start:end], alone) < 1e-5
        assert max_diff(pool.recurrent[0][slots[s]], alone_pool.recurrent[0][0]) < 1e-5


def test_unknown_layer_kind_is_a_one_line_error():
    """A layer_types entry naming no kind qinfer knows: the field is named, and the kinds."""
    cfg = dict(
        model_type="qwen3_5_text",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=[LINEAR_ATTENTION, "mamba"],
    )
    with pytest.raises(ConfigError, match="'layer_types' names unknown kinds") as error:
        config_from_hf(cfg)
    assert "\n" not in str(error.value) and "linear_attention" in str(error.value)


def test_linear_attention_without_deltanet_family_is_refused():
    """A family without DeltaNet layers asked for one names the field."""
    cfg = dict(
        model_type="qwen3",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        sliding_window=8,
        use_sliding_window=True,
        layer_types=[LINEAR_ATTENTION, "full_attention"],
    )
    with pytest.raises(ConfigError, match="'layer_types' asks for linear_attention"):
        config_from_hf(cfg)


def test_left_padding_is_refused():
    """Left-padded rows would feed the padding into the recurrent state: refused."""
    model = random_model("qwen3_5", **HYBRID["qwen3_5"])
    with pytest.raises(QinferError, match="left_padding"):
        model.make_cache(2, left_padding=[0, 1])

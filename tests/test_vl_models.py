"""Qwen2.5-VL and Qwen3-VL language models with images (models/qwen2_5_vl.py, qwen3_vl.py,
layers/rope.py's MRoPE, the `images` of a ForwardBatch, qinfer.vision.VisionLanguageModel)
against transformers' Qwen2_5_VLForConditionalGeneration and Qwen3VLForConditionalGeneration
in fp32, on tiny random checkpoints saved with save_pretrained."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from checkpoints import spread_weights
from PIL import Image

from qinfer.attention.reference import ReferenceAttention
from qinfer.attention.sdpa import sdpa_for
from qinfer.core.errors import ConfigError, QinferError, RequestError
from qinfer.core.forward_batch import BatchImages, ForwardBatch
from qinfer.core.model_config import RopeConfig
from qinfer.layers.rope import MRoPE, RoPE
from qinfer.models import config_from_hf
from qinfer.vision import ImagePrompt, VisionLanguageModel, preprocess_images

TOLERANCE = 1e-4  # fp32 logits of order 1-5 (measured ~1e-5)

#: Token ids inside the tiny vocabulary: <|image_pad|>, <|video_pad|>, <|vision_start|>, <|vision_end|>.
SPECIAL = dict(
    image_token_id=250, video_token_id=253, vision_start_token_id=251, vision_end_token_id=252
)
IMAGE, START, END = 250, 251, 252

#: 3 text layers (DeepStack adds after layers 0 and 1), 4 query / 2 KV heads of 16 dims: 8
#: rotary frequencies, split 2 / 3 / 3 between the temporal, height and width positions.
TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)
#: The vision towers of tests/test_vision.py: windows and a full-attention block (Qwen2.5-VL),
#: a resampled position table and two DeepStack features (Qwen3-VL).
VISION = {
    "qwen2.5-vl": dict(
        depth=3,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        window_size=56,
        fullatt_block_indexes=[1],
    ),
    "qwen3-vl": dict(
        depth=3,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        patch_size=16,
        num_position_embeddings=36,
        deepstack_visual_indexes=[0, 2],
    ),
}
#: The real preprocessor configs, with small pixel budgets.
PREPROCESSOR = {
    "qwen2.5-vl": {
        "min_pixels": 3136,
        "max_pixels": 200704,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
    },
    "qwen3-vl": {
        "size": {"longest_edge": 262144, "shortest_edge": 4096},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessorFast",
    },
}
FAMILIES = list(VISION)


def make_image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


#: Two images: 6 x 8 and 8 x 4 patches (12 and 8 tokens; wider, then taller than long).
IMAGES = [make_image(112, 84, 0), make_image(56, 112, 1)]


def save_vl_checkpoint(
    folder, family: str, text: dict = TEXT, special: dict = SPECIAL, vision: dict | None = None
):
    """transformers' random `family` model (`vision`'s tower, default VISION's; `text`'s
    text model, `special`'s vision token ids) with spread weights, saved to `folder` with
    its preprocessor config; returns the model (the reference)."""
    import transformers

    vision = vision or VISION[family]
    if family == "qwen2.5-vl":
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **special)
        reference = transformers.Qwen2_5_VLForConditionalGeneration(config)
    else:
        config = transformers.Qwen3VLConfig(
            text_config=dict(text, head_dim=16), vision_config=vision, **special
        )
        reference = transformers.Qwen3VLForConditionalGeneration(config)
    spread_weights(reference.eval())
    reference.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR[family]))
    return reference


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    """(our VisionLanguageModel, transformers' model) of one family's random checkpoint."""
    folder = tmp_path_factory.mktemp(request.param)
    reference = save_vl_checkpoint(folder, request.param)
    return VisionLanguageModel.load(folder, dtype="float32"), reference


def image_run(count: int) -> list[int]:
    """An image's tokens: <|vision_start|>, `count` image pads, <|vision_end|>."""
    return [START, *[IMAGE] * count, END]


def prompt(kind: str, vl: VisionLanguageModel) -> ImagePrompt:
    """A prompt of each kind the tests run, its images' runs sized to the model's grids."""
    if kind == "text only":
        return ImagePrompt([3, 14, 15, 92, 65, 35, 89, 79])
    counts = [t * h * w // 4 for t, h, w in preprocess_images(IMAGES, vl.settings).grids]
    if kind == "one image":  # the prompt starts with it
        return ImagePrompt([*image_run(counts[0]), 7, 8, 9], IMAGES[:1])
    if kind == "two images":  # the prompt ends with the second
        ids = [5, 6, *image_run(counts[0]), 10, 11, 12, *image_run(counts[1])]
        return ImagePrompt(ids, IMAGES)
    # an image mid-conversation: text, the image, text
    ids = [1, 2, 3, 4, *image_run(counts[1]), 20, 21, 22, 23, 24]
    return ImagePrompt(ids, IMAGES[1:])


def reference_logits(checkpoint, p: ImagePrompt, image_token: int = IMAGE) -> torch.Tensor:
    """transformers' logits (L, vocab) of one prompt, its images (preprocessed with the
    settings of checkpoint's first part) through its own tower; image_token: the
    checkpoint's image token id."""
    vl, reference = checkpoint
    ids = torch.tensor([list(p.token_ids)])
    inputs = {"input_ids": ids}
    if p.images:
        patched = preprocess_images(p.images, vl.settings)  # byte-equal to its processor's
        inputs |= dict(
            pixel_values=patched.pixel_values,
            image_grid_thw=torch.tensor(patched.grids),
            mm_token_type_ids=(ids == image_token).int(),  # where get_rope_index finds images
        )
    with torch.no_grad():
        return reference(**inputs).logits[0]


KINDS = ["one image", "two images", "image mid-conversation", "text only"]


@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_transformers(checkpoint, kind):
    vl = checkpoint[0]
    p = prompt(kind, vl)
    ours = vl.prefill([p]).logits[0]
    expected = reference_logits(checkpoint, p)
    assert ours.shape == expected.shape == (len(p.token_ids), TEXT["vocab_size"])
    assert expected.abs().max() > 1  # logits of order 1
    assert (ours - expected).abs().max() < TOLERANCE


def test_images_change_the_logits_of_the_rows_after_them(checkpoint):
    """The embeddings (and DeepStack features) reach the text model: the same ids with
    other pixels give other logits after the image, the same before it."""
    vl = checkpoint[0]
    p = prompt("image mid-conversation", vl)
    other = ImagePrompt(p.token_ids, [make_image(56, 112, 7)])
    a, b = vl.prefill([p]).logits[0], vl.prefill([other]).logits[0]
    start = list(p.token_ids).index(START)
    assert torch.equal(a[: start + 1], b[: start + 1])
    assert (a[-1] - b[-1]).abs().max() > 0.1


def test_prefill_then_decode_equals_one_forward(checkpoint):
    """Prefill up to two tokens after the image, then decode the rest one by one and as a
    chunk of two: every row's logits are those of one forward of the whole prompt (decode
    positions continue at index + delta in all three sections)."""
    vl = checkpoint[0]
    p = prompt("image mid-conversation", vl)
    ids = list(p.token_ids)
    whole = vl.prefill([p]).logits[0]
    cut = ids.index(END) + 3
    state = vl.prefill([ImagePrompt(ids[:cut], p.images)], max_length=len(ids))
    rows = [state.logits[0]]
    rows.append(vl.decode(state, torch.tensor([ids[cut : cut + 1]]))[0])
    rows.append(vl.decode(state, torch.tensor([ids[cut + 1 : cut + 3]]))[0])
    for i in range(cut + 3, len(ids)):
        rows.append(vl.decode(state, torch.tensor([[ids[i]]]))[0])
    assert (torch.cat(rows) - whole).abs().max() < TOLERANCE


def test_a_batch_of_an_image_prompt_and_a_text_prompt_equals_each_alone(checkpoint):
    """Left-padded to one length, each row's logits and its next decode steps are those it
    gets alone."""
    vl = checkpoint[0]
    prompts = [prompt("two images", vl), prompt("text only", vl)]
    steps = torch.tensor([[30, 31], [40, 41]])  # (B, 2): two decode steps of each row
    batch = vl.prefill(prompts, max_length=64)
    decoded = [vl.decode(batch, steps[:, i : i + 1]) for i in range(2)]
    for b, p in enumerate(prompts):
        alone = vl.prefill([p], max_length=64)
        L = len(p.token_ids)
        assert (batch.logits[b, -L:] - alone.logits[0]).abs().max() < TOLERANCE
        for i in range(2):
            step = vl.decode(alone, steps[b : b + 1, i : i + 1])
            assert (decoded[i][b] - step[0]).abs().max() < TOLERANCE


@pytest.fixture(scope="module")
def text_only_folder(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("qwen3")
    config = Qwen3Config(**{k: v for k, v in TEXT.items() if k != "rope_parameters"}, head_dim=16)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


def test_an_image_sent_to_a_text_only_model_is_refused_naming_it(text_only_folder, tmp_path):
    vl = VisionLanguageModel.load(text_only_folder, dtype="float32")
    path = tmp_path / "cat.png"
    IMAGES[0].save(path)
    with pytest.raises(
        RequestError, match=r"^image 0 \(.*cat\.png\) was sent to model_type 'qwen3', a text-only"
    ):
        vl.prefill([ImagePrompt([1, IMAGE, 2], [path])])


def test_a_text_only_model_refuses_a_batch_with_images(text_only_folder):
    model = VisionLanguageModel.load(text_only_folder, dtype="float32").model
    cache = model.make_cache(1, max_length=3)
    batch = ForwardBatch.from_rows(
        torch.tensor([[1, 2, 3]]),
        0,
        ReferenceAttention(cache, 1, 3, "causal", sdpa_for(model.features)),
    )
    images = BatchImages(torch.tensor([1]), torch.zeros(1, TEXT["hidden_size"]))
    with pytest.raises(QinferError, match=r"model_type 'qwen3' is a text-only model"):
        model.forward(dataclasses.replace(batch, images=images))


@pytest.mark.parametrize("family", FAMILIES)
def test_mrope_rotation_equals_transformers_at_real_sizes(family):
    """cos/sin of (3, T) positions whose sections differ, at head_dim 128 and the real
    sections: those of transformers' rotary embedding (whose two halves repeat)."""
    from transformers import Qwen2_5_VLTextConfig, Qwen3VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    interleaved = family == "qwen3-vl"
    section = [24, 20, 20] if interleaved else [16, 24, 24]
    config_class = Qwen3VLTextConfig if interleaved else Qwen2_5_VLTextConfig
    embedding_class = Qwen3VLTextRotaryEmbedding if interleaved else Qwen2_5_VLRotaryEmbedding
    parameters = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": section}
    hf_config = config_class(hidden_size=2048, num_attention_heads=16, rope_parameters=parameters)
    positions = torch.randint(0, 5000, (3, 37), generator=torch.Generator().manual_seed(0))
    # (3, 1, T) -> cos, sin (1, T, 128), the halves equal
    cos, sin = embedding_class(hf_config)(torch.zeros(1), positions[:, None])
    rope = RopeConfig(theta=1e6, mrope_section=tuple(section), mrope_interleaved=interleaved)
    our_cos, our_sin = MRoPE(128, 32768, rope).rotation(positions, torch.float32)  # (T, 1, 64)
    assert torch.equal(our_cos[:, 0], cos[0, :, :64])
    assert torch.equal(our_sin[:, 0], sin[0, :, :64])


def test_mrope_rotates_text_rows_as_rope():
    """Text tokens have one position in all three sections: the seed's call on (B, L, H, D)
    rows gives RoPE's rotation, for either layout."""
    x = torch.randn(2, 5, 3, 16, generator=torch.Generator().manual_seed(0))
    offsets = torch.tensor([0, 7])
    expected = RoPE(16, 64, 10000.0)(x, offsets)
    for interleaved in (False, True):
        rope = RopeConfig(mrope_section=(2, 3, 3), mrope_interleaved=interleaved)
        assert torch.equal(MRoPE(16, 64, rope)(x, offsets), expected)


def test_an_original_flat_qwen2_5_vl_config_reads_its_mrope():
    """The released Qwen2.5-VL config.json: text fields at the top level, `rope_scaling`
    of type "mrope", no head_dim, tied embeddings at the top."""
    config = config_from_hf(
        {
            "model_type": "qwen2_5_vl",
            "hidden_size": 2048,
            "intermediate_size": 11008,
            "num_hidden_layers": 36,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "rope_theta": 1000000.0,
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "tie_word_embeddings": True,
            "image_token_id": 151655,
            "vision_config": {"depth": 32},
        }
    )
    assert (config.head_dim, config.rope.type, config.rope.theta) == (128, "default", 1e6)
    assert config.rope.mrope_section == (16, 24, 24) and not config.rope.mrope_interleaved
    assert config.tie_word_embeddings and config.wiring.qkv_bias and not config.wiring.o_bias
    assert config.image_token_id == 151655


def test_an_mrope_section_that_does_not_fill_the_rotary_half_is_refused():
    text = {**TEXT, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 4]}}
    with pytest.raises(ConfigError, match=r"^mrope_section \[2, 3, 4\] must be 3 sizes adding"):
        config_from_hf({"model_type": "qwen3_vl", "text_config": {**text, "head_dim": 16}})

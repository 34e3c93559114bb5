"""Images in (qinfer.vision) against transformers: the Qwen2-VL PIL image processor's patches,
byte for byte, and the Qwen2.5-VL vision tower's embeddings in fp32, on a random checkpoint."""

from __future__ import annotations

import io
import json
import struct
import zlib

import numpy as np
import pytest
import torch
from checkpoints import spread_weights
from PIL import Image

from qinfer.core.errors import ConfigError, RequestError
from qinfer.vision import (
    ImageSettings,
    load_image_settings,
    load_vision_encoder,
    open_image,
    preprocess_images,
)
from qinfer.vision.grid import patch_positions, window_order
from qinfer.vision.image import smart_resize
from qinfer.vision.mrope import mrope_positions

TOLERANCE = 1e-4  # fp32 embeddings of order 1 (measured ~1e-6)
HALF_TOLERANCE = 0.1  # bf16 weights against the fp32 tower, relative to its largest value

#: Qwen2.5-VL's preprocessor_config.json, with a small pixel budget.
QWEN2_5_PREPROCESSOR = {
    "min_pixels": 3136,
    "max_pixels": 200704,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
}
#: Qwen3-VL's: the budget as a size dict, 16-pixel patches, mean and std 0.5.
QWEN3_PREPROCESSOR = {
    "size": {"longest_edge": 262144, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessorFast",
}

#: (width, height, mode, format): upscaled, downscaled, elongated, transparent, palette,
#: greyscale, lossy.
IMAGES = [
    (100, 60, "RGB", "PNG"),
    (37, 300, "RGBA", "PNG"),
    (640, 480, "L", "PNG"),
    (10, 10, "P", "PNG"),
    (1000, 30, "RGB", "JPEG"),
    (333, 517, "RGB", "JPEG"),
]

#: A tiny Qwen2.5-VL: 3 vision blocks, block 1 with full attention, the others in windows of
#: 2 x 2 merged tokens (56 pixels), so that a grid of odd merged size has ragged windows.
TINY_VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=64,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=56,
    fullatt_block_indexes=[1],
)
TINY_TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def make_image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 4 if mode == "RGBA" else 3), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGBA" if mode == "RGBA" else "RGB")
    return image.convert(mode) if mode in ("L", "P") else image


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def image_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    paths = []
    for i, (width, height, mode, fmt) in enumerate(IMAGES):
        path = folder / f"image{i}.{fmt.lower()}"
        path.write_bytes(encoded(make_image(width, height, mode, i), fmt))
        paths.append(path)
    return paths


@pytest.mark.parametrize(
    "preprocessor", [QWEN2_5_PREPROCESSOR, QWEN3_PREPROCESSOR], ids=["qwen2.5-vl", "qwen3-vl"]
)
def test_patches_equal_transformers_pil_processor(preprocessor, image_files, tmp_path):
    """Every image (sizes up and down, aspect ratios to 33:1, RGBA, palette, greyscale, JPEG;
    a path or its bytes) gives transformers' pixel_values byte for byte, and its grids."""
    from transformers import Qwen2VLImageProcessorPil

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    reference = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    expected = reference([Image.open(p) for p in image_files], return_tensors="pt")
    sources = [p.read_bytes() if i % 2 else p for i, p in enumerate(image_files)]
    ours = preprocess_images(sources, load_image_settings(tmp_path))
    assert [list(g) for g in ours.grids] == expected["image_grid_thw"].tolist()
    assert ours.pixel_values.dtype == torch.float32
    assert torch.equal(ours.pixel_values, expected["pixel_values"])


def test_a_file_that_is_not_an_image_is_refused_naming_it(tmp_path):
    path = tmp_path / "notes.png"
    path.write_text("not a picture")
    with pytest.raises(RequestError, match=r"^image .*notes\.png is not an image file"):
        open_image(path)


def test_a_truncated_png_is_refused_naming_it():
    data = encoded(make_image(64, 64, "RGB", 0), "PNG")
    with pytest.raises(RequestError, match=r"^image cut\.png is truncated or corrupt"):
        open_image(data[: len(data) // 2], "cut.png")


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height RGB pixels but holds one empty compressed block:
    its header is valid, its pixels were never there."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


def test_an_image_over_the_pixel_limit_is_refused_from_its_header():
    """20,000 x 20,000 (1.2 GB as RGB) is refused at once, nothing decoded; so is an image
    over a lower limit of the caller's, with its size."""
    with pytest.raises(RequestError, match=r"^image huge\.png is over the pixel limit"):
        open_image(png_header(20_000, 20_000), "huge.png")
    with pytest.raises(RequestError, match=r"^image big\.png is 4000 x 3000 = 12,000,000 pixels"):
        open_image(png_header(4000, 3000), "big.png", max_pixels=10_000_000)


def test_an_image_more_elongated_than_200_to_1_is_refused():
    settings = ImageSettings.from_hf(QWEN2_5_PREPROCESSOR)
    with pytest.raises(RequestError, match=r"^image strip is 2010 x 10: more elongated"):
        smart_resize(10, 2010, settings, "strip")
    with pytest.raises(RequestError, match=r"^image empty is 0 x 5: it has no pixels"):
        smart_resize(5, 0, settings, "empty")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"patch_size": "14"}, "patch_size"),
        ({"image_mean": [0.5, 0.5]}, "image_mean"),
        ({"min_pixels": 10**9}, "min_pixels"),
        ({"do_normalize": False}, "do_normalize"),
        ({"size": [1, 2]}, "size"),
    ],
)
def test_a_bad_preprocessor_config_names_the_field(change, field):
    with pytest.raises(ConfigError, match=f"^preprocessor config field '{field}'"):
        ImageSettings.from_hf({**QWEN2_5_PREPROCESSOR, **change})


@pytest.mark.parametrize("grids", [[(1, 8, 12)], [(1, 10, 6), (2, 4, 14)], [(1, 14, 2), (1, 2, 2)]])
def test_patch_positions_and_windows_match_transformers(grids):
    """Each patch's (row, column) and the window order and bounds are transformers' (a clip
    of two frames, ragged edge windows, an image smaller than one window)."""
    from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

    grid_thw = torch.tensor(grids)
    assert torch.equal(patch_positions(grids, 2), get_vision_position_ids(grid_thw, 2))
    order, bounds = window_order(grids, merge_size=2, window_size=56, patch_size=14)
    expected_order, expected_bounds = get_vision_window_index(grid_thw, 2, 56, 14)
    assert torch.equal(order, expected_order)
    assert bounds == expected_bounds.tolist()


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    """(folder, transformers' vision tower) of a random tiny Qwen2.5-VL checkpoint."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    folder = tmp_path_factory.mktemp("qwen2.5-vl")
    config = Qwen2_5_VLConfig(text_config=TINY_TEXT, vision_config=TINY_VISION)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    spread_weights(model.model.visual)
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(QWEN2_5_PREPROCESSOR))
    return folder, model.model


#: Images whose grids are (8, 12): 2 x 3 whole windows, and (10, 6): ragged edge windows.
ENCODER_IMAGES = {"one image": [(168, 112)], "two images": [(168, 112), (84, 140)]}


@pytest.mark.parametrize("sizes", list(ENCODER_IMAGES.values()), ids=list(ENCODER_IMAGES))
def test_embeddings_match_transformers_vision_tower(qwen2_5_vl, sizes):
    folder, reference = qwen2_5_vl[0], qwen2_5_vl[1].visual
    images = [make_image(w, h, "RGB", i) for i, (w, h) in enumerate(sizes)]
    patched = preprocess_images(images, load_image_settings(folder))
    encoder = load_vision_encoder(folder)
    with torch.no_grad():
        ours = encoder(patched.pixel_values, patched.grids)
        expected = reference(patched.pixel_values, grid_thw=torch.tensor(patched.grids))
    expected = expected.pooler_output
    tokens = sum(t * h * w for t, h, w in patched.grids) // 4
    assert ours.shape == expected.shape == (tokens, TINY_VISION["out_hidden_size"])
    assert ours.dtype == torch.float32
    assert expected.abs().max() > 0.5  # embeddings of order 1
    assert (ours - expected).abs().max() < TOLERANCE


def test_a_bfloat16_tower_stays_close_to_float32(qwen2_5_vl):
    folder, _ = qwen2_5_vl
    patched = preprocess_images([make_image(168, 112, "RGB", 0)], load_image_settings(folder))
    full = load_vision_encoder(folder)(patched.pixel_values, patched.grids)
    half = load_vision_encoder(folder, dtype=torch.bfloat16)(patched.pixel_values, patched.grids)
    assert half.dtype == torch.float32  # the residual stream and the output stay fp32
    assert (half - full).abs().max() < HALF_TOLERANCE * full.abs().max()


def test_a_checkpoint_without_a_vision_tower_is_refused_naming_its_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(ConfigError, match=r"model_type 'qwen3' has no vision encoder; supported"):
        load_vision_encoder(tmp_path)


def test_a_bad_vision_config_names_the_field(qwen2_5_vl, tmp_path):
    folder, _ = qwen2_5_vl
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"]["fullatt_block_indexes"] = [3]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"'vision_config.fullatt_block_indexes' names a block"):
        load_vision_encoder(tmp_path)


IMAGE_TOKEN = 151655  # Qwen2.5-VL's <|image_pad|>
VISION_START, VISION_END = 151652, 151653


def prompt_with_images(grids, text_runs):
    """Token ids: text_runs[0] text tokens, then per image <vision_start>, its pads,
    <vision_end> and text_runs[i + 1] text tokens."""
    ids = list(range(10, 10 + text_runs[0]))
    for (t, h, w), after in zip(grids, text_runs[1:], strict=True):
        ids += [VISION_START, *[IMAGE_TOKEN] * (t * h * w // 4), VISION_END]
        ids += list(range(20, 20 + after))
    return ids


@pytest.mark.parametrize(
    ("grids", "text_runs"),
    [
        ([(1, 8, 12)], [5, 3]),  # wider than tall: the text resumes past its 6 columns
        ([(1, 10, 6), (1, 4, 4)], [2, 4, 0]),  # taller; a second image; the prompt ends on one
        ([(1, 2, 2)], [0, 7]),  # the prompt starts with an image
    ],
)
def test_mrope_positions_match_transformers_get_rope_index(qwen2_5_vl, grids, text_runs):
    model = qwen2_5_vl[1]
    ids = prompt_with_images(grids, text_runs)
    positions, delta = mrope_positions(ids, IMAGE_TOKEN, grids, merge_size=2)
    input_ids = torch.tensor([ids])
    expected, expected_delta = model.get_rope_index(
        input_ids, (input_ids == IMAGE_TOKEN).int(), image_grid_thw=torch.tensor(grids)
    )
    assert torch.equal(positions, expected[:, 0])
    assert delta == expected_delta.item()


def test_mrope_positions_refuse_tokens_and_grids_that_disagree():
    ids = prompt_with_images([(1, 4, 4)], [1, 1])
    with pytest.raises(RequestError, match=r"^image 0's grid \(1, 4, 6\) needs 6 image tokens"):
        mrope_positions(ids, IMAGE_TOKEN, [(1, 4, 6)], merge_size=2)
    with pytest.raises(RequestError, match="more images than"):
        mrope_positions(ids, IMAGE_TOKEN, [(1, 4, 4), (1, 2, 2)], merge_size=2)
    with pytest.raises(RequestError, match="more images' tokens than images"):
        mrope_positions(ids, IMAGE_TOKEN, [], merge_size=2)


#: A tiny Qwen3-VL: 3 blocks, DeepStack features after blocks 0 and 2, a 6 x 6 position
#: table resampled to each grid.
TINY_QWEN3_VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=64,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=36,
    deepstack_visual_indexes=[0, 2],
)


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    """(folder, transformers' model) of a random tiny Qwen3-VL checkpoint."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    folder = tmp_path_factory.mktemp("qwen3-vl")
    text = dict(TINY_TEXT, head_dim=16)
    config = Qwen3VLConfig(text_config=text, vision_config=TINY_QWEN3_VISION)
    model = Qwen3VLForConditionalGeneration(config).eval()
    spread_weights(model.model.visual)
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(QWEN3_PREPROCESSOR))
    return folder, model.model


#: Grids (8, 12) and (10, 6) in 16-pixel patches, over the 6 x 6 table: resampled up and down.
QWEN3_IMAGES = {"one image": [(192, 128)], "two images": [(192, 128), (96, 160)]}


@pytest.mark.parametrize("sizes", list(QWEN3_IMAGES.values()), ids=list(QWEN3_IMAGES))
def test_qwen3_embeddings_and_deepstack_match_transformers(qwen3_vl, sizes):
    folder, reference = qwen3_vl[0], qwen3_vl[1].visual
    images = [make_image(w, h, "RGB", i) for i, (w, h) in enumerate(sizes)]
    settings = ImageSettings.from_hf(
        {**QWEN3_PREPROCESSOR, "size": {"longest_edge": 10**6, "shortest_edge": 1}}
    )
    patched = preprocess_images(images, settings)
    with torch.no_grad():
        ours = load_vision_encoder(folder)(patched.pixel_values, patched.grids)
        expected = reference(patched.pixel_values, grid_thw=torch.tensor(patched.grids))
    assert ours.embeddings.shape == expected.pooler_output.shape
    assert expected.pooler_output.abs().max() > 0.5  # embeddings of order 1
    assert (ours.embeddings - expected.pooler_output).abs().max() < TOLERANCE
    assert len(ours.deepstack) == len(expected.deepstack_features) == 2
    for feature, expected_feature in zip(ours.deepstack, expected.deepstack_features, strict=True):
        assert (feature - expected_feature).abs().max() < TOLERANCE


def test_qwen3_mrope_positions_match_transformers_get_rope_index(qwen3_vl):
    grids = [(1, 8, 12), (1, 10, 6)]
    ids = prompt_with_images(grids, [3, 2, 4])
    positions, delta = mrope_positions(ids, IMAGE_TOKEN, grids, merge_size=2)
    input_ids = torch.tensor([ids])
    expected, expected_delta = qwen3_vl[1].get_rope_index(
        input_ids, (input_ids == IMAGE_TOKEN).int(), image_grid_thw=torch.tensor(grids)
    )
    assert torch.equal(positions, expected[:, 0])
    assert delta == expected_delta.item()


def test_a_bad_qwen3_vision_config_names_the_field(qwen3_vl, tmp_path):
    config = json.loads((qwen3_vl[0] / "config.json").read_text())
    config["vision_config"]["num_position_embeddings"] = 30
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConfigError, match=r"'vision_config.num_position_embeddings' must be a square"
    ):
        load_vision_encoder(tmp_path)

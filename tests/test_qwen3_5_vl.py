"""Qwen3.5 with images (`Qwen3_5ForConditionalGeneration`): its vision tower (Qwen3-VL's
without DeepStack, `vision.qwen3_vl.Qwen3_5VisionConfig`) from the checkpoint folder and
from llama.cpp's projector file (`--mmproj`, beside the `qwen35` text file), the hybrid text
model's M-RoPE over an image's tokens, offline (`VisionLanguageModel`) and through the
engine (`LLM.generate`), against transformers in fp32 on a tiny random checkpoint.

The folder's preprocessor takes the released pixel budget (which a projector file does not
store: qinfer takes the family's), so the folder and the files see the same patches; the
converter runs as tests/test_vl_gguf.py runs it.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from checkpoints import HYBRID, TINY, max_diff, spread_weights
from test_vl_engine import SPECIAL, VL_TEMPLATE, VOCAB, image_prompt, save_vl_tokenizer
from test_vl_gguf import RELEASED_BUDGET, convert
from test_vl_models import PREPROCESSOR, VISION, make_image

from qinfer import LLM, SamplingParams
from qinfer.attention.deltanet import CHUNK_SIZE
from qinfer.vision import ImagePrompt, VisionLanguageModel, preprocess_images

pytestmark = pytest.mark.slow

#: fp32 logits of order 1 to 10 against transformers' in float64: measured 2026-12-06 (AMD
#: EPYC), the MoE's largest difference is 5.2e-5, where transformers' own fp32 is 1.8e-4 away
#: from its float64 (one image position of this random MoE amplifies fp32 rounding), so an
#: fp32 reference would measure transformers' rounding as much as ours.
TOLERANCE = 1e-4
ROPE = HYBRID["qwen3_5"]["rope_parameters"]
#: Qwen3.5's and Qwen3.5-MoE's text models (tests/checkpoints.py's: DeltaNet, gated attention,
#: experts; interleaved M-RoPE sections 2 / 1 / 1 of the 4 rotary frequencies) with the
#: vision tokens in their vocabulary.
TEXT = {
    family: {**TINY, **HYBRID[family], "vocab_size": VOCAB, "rope_parameters": ROPE}
    for family in ("qwen3_5", "qwen3_5_moe")
}
#: Qwen3-VL's tiny tower without its DeepStack blocks.
TOWER = {k: v for k, v in VISION["qwen3-vl"].items() if k != "deepstack_visual_indexes"}
#: 112 x 84 pixels, resized to the released minimum of 65536: 16 x 16 patches, 64 tokens.
PICTURE = make_image(112, 84, 0)
#: Text before the image so that the prompt runs past one chunk of the DeltaNet.
BEFORE = tuple(range(10, 10 + CHUNK_SIZE // 2))
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
#: Small blocks and chunks: the prompt's image splits between steps.
ENGINE = dict(
    block_size=4, num_kv_blocks=96, max_num_batched_tokens=24, max_num_seqs=4, dtype="float32"
)


@dataclass(frozen=True)
class Files:
    """The checkpoint folder, its converted text and projector files, transformers' model."""

    folder: Path
    text: Path
    mmproj: Path
    reference: torch.nn.Module
    family: str


@pytest.fixture(scope="module", params=sorted(TEXT))
def files(request, tmp_path_factory) -> Files:
    import transformers

    family = request.param
    root = tmp_path_factory.mktemp(family)
    folder = root / "hf"
    if family == "qwen3_5":
        config_class = transformers.Qwen3_5Config
        model_class = transformers.Qwen3_5ForConditionalGeneration
    else:
        config_class = transformers.Qwen3_5MoeConfig
        model_class = transformers.Qwen3_5MoeForConditionalGeneration
    config = config_class(text_config=TEXT[family], vision_config=TOWER, **SPECIAL)
    torch.manual_seed(0)
    reference = model_class(config).eval()
    spread_weights(reference, gain=0.5)  # as tests/checkpoints.py spreads a hybrid model's
    reference.save_pretrained(folder)
    preprocessor = {**PREPROCESSOR["qwen3-vl"], **RELEASED_BUDGET["qwen3-vl"]}
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    save_vl_tokenizer(folder, VL_TEMPLATE)
    text, mmproj = root / "text.gguf", root / "mmproj.gguf"
    convert(
        folder,
        ["--no-mtp", "--outtype", "f32", "--outfile", str(text)],
        ["--mmproj", "--outtype", "f32", "--outfile", str(mmproj)],
    )
    return Files(folder, text, mmproj, reference, family)


@pytest.fixture(scope="module", params=["folder", "gguf"])
def vl(request, files) -> VisionLanguageModel:
    """The model with its tower: the folder's, or the text file's with its projector."""
    if request.param == "folder":
        return VisionLanguageModel.load(files.folder, dtype="float32")
    return VisionLanguageModel.load(files.text, dtype="float32", mmproj=files.mmproj)


def reference_inputs(vl: VisionLanguageModel, p: ImagePrompt) -> dict[str, torch.Tensor]:
    """transformers' inputs of prompt `p` (its images patched by qinfer's preprocessing,
    which tests/test_vision.py holds to transformers')."""
    patched = preprocess_images(p.images, vl.settings)
    ids = torch.tensor([list(p.token_ids)])
    return dict(
        input_ids=ids,
        pixel_values=patched.pixel_values,
        image_grid_thw=torch.tensor(patched.grids),
        mm_token_type_ids=(ids == SPECIAL["image_token_id"]).int(),
    )


def test_the_tower_has_no_deepstack_and_the_text_model_an_image_token(vl):
    assert vl.encoder is not None and vl.encoder.config.deepstack_visual_indexes == ()
    assert len(vl.encoder.deepstack_mergers) == 0
    assert vl.model.config.image_token_id == SPECIAL["image_token_id"]
    assert vl.model.config.rope.mrope_section == (2, 1, 1)


def test_logits_with_an_image_equal_transformers(files, vl):
    """A prompt of text, an image of 64 tokens and text, past one DeltaNet chunk: the fp32
    logits of every position are transformers' (computed in float64)."""
    p = image_prompt(vl, [PICTURE], before=BEFORE)
    assert len(p.token_ids) > CHUNK_SIZE
    ours = vl.prefill([p]).logits
    exact = copy.deepcopy(files.reference).double()
    exact.set_experts_implementation("eager")  # the grouped experts take no float64
    inputs = {
        k: v.double() if v.is_floating_point() else v for k, v in reference_inputs(vl, p).items()
    }
    with torch.no_grad():
        expected = exact(**inputs).logits.float()
    assert expected.abs().max() > 1
    assert max_diff(ours, expected) < TOLERANCE


def test_greedy_tokens_through_the_engine_equal_transformers(files, vl):
    """`LLM.generate` with the image (small blocks, chunked prefill): transformers' greedy
    generate of the same prompt."""
    p = image_prompt(vl, [PICTURE], before=BEFORE)
    [out] = LLM(vl, **ENGINE).generate(p, GREEDY, use_tqdm=False)
    reference = files.reference
    reference.generation_config.eos_token_id = None  # as ignore_eos
    with torch.no_grad():
        generated = reference.generate(
            **reference_inputs(vl, p), max_new_tokens=GREEDY.max_tokens, do_sample=False
        )
    assert out.token_ids == generated[0, len(p.token_ids) :].tolist()

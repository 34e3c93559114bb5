"""Qwen2.5-VL and Qwen3-VL from GGUF files as llama.cpp ships them: a text model
(architectures qwen2vl and qwen3vl; models/qwen2_5_vl.py, qwen3_vl.py) and its projector
file (`--mmproj`; qinfer.vision.mmproj), both written by llama.cpp's own converter from
tiny random transformers checkpoints, against transformers in fp32.

The converter (convert_hf_to_gguf.py, conversion/, gguf-py/ of the llama.cpp that
llama-cpp-python 0.3.36 vendors) is what `make setup-test` extracts into the venv
(Makefile: CONVERTER). It runs in a process of its own, where its gguf-py is the `gguf`
package, with one change: the vocabulary's pre-tokenizer is named "qwen2", since it
recognises a pre-tokenizer by hashing a released tokenizer's tokens and a test tokenizer
matches none. What it writes for tensors and the rest of the metadata is its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import gguf
import openai
import pytest
import torch
from checkpoints import build_checkpoint
from gguf_files import LLAMA_CPP_CONVERTER, write_gguf_model
from servers import serving
from test_server_vision import MAX_TOKENS, MODEL, chat_image, data_url, png
from test_vl_engine import SPECIAL, VL_TEMPLATE, VOCAB, image_prompt, save_vl_tokenizer
from test_vl_models import (
    PREPROCESSOR,
    TEXT,
    VISION,
    make_image,
    reference_logits,
    save_vl_checkpoint,
)

from qinfer import LLM, SamplingParams
from qinfer.cli import main
from qinfer.core.errors import ConfigError, RequestError, WeightsError
from qinfer.linear import DenseLinear
from qinfer.linear.choose import choose_paths
from qinfer.vision import (
    ImagePrompt,
    VisionLanguageModel,
    load_image_settings,
    preprocess_images,
)
from qinfer.vision.mmproj import PATCH_EMBED, PATCH_FRAMES, ProjectorWeights, load_projector
from qinfer.weights.gguf_file import read_gguf

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = pytest.mark.slow

CONVERTER = LLAMA_CPP_CONVERTER

#: Runs convert_hf_to_gguf.py (in argv[1]) once per job of argv[2] (a JSON list of
#: argument lists), in one process.
RUN_CONVERTER = """
import json, runpy, sys
root, jobs = sys.argv[1], json.loads(sys.argv[2])
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
script = root + "/convert_hf_to_gguf.py"
converter = runpy.run_path(script, run_name="converter")
for job in jobs:
    sys.argv = [script, *job]
    converter["main"]()
"""

TOLERANCE = 1e-4  # fp32 logits of order 1-5 (measured: 5.1e-6 Qwen2.5-VL, 2.0e-6 Qwen3-VL)
START, END, IMAGE = SPECIAL["vision_start_token_id"], SPECIAL["vision_end_token_id"], 263
FAMILIES = list(VISION)

#: VISION's towers, Qwen2.5-VL's with transformers' window of 112 pixels (a projector
#: file does not store it: qinfer takes that default): 2 x 2 windows over IMAGE.
GGUF_VISION = {
    "qwen2.5-vl": {k: v for k, v in VISION["qwen2.5-vl"].items() if k != "window_size"},
    "qwen3-vl": VISION["qwen3-vl"],
}
#: The pixel budgets of the released checkpoints' preprocessor configs (Qwen2.5-VL-3B,
#: Qwen3-VL-4B), which a projector file does not store either.
RELEASED_BUDGET = {
    "qwen2.5-vl": {"min_pixels": 3136, "max_pixels": 12845056},
    "qwen3-vl": {"size": {"shortest_edge": 65536, "longest_edge": 16777216}},
}
#: 224 x 168 pixels: 16 x 12 patches of Qwen2.5-VL (8 x 6 tokens in 2 x 2 windows); Qwen3-VL
#: resizes it to its minimum of 65536 pixels (10 x 7 tokens).
PICTURE = make_image(224, 168, 3)


@dataclass(frozen=True)
class Files:
    """One family's checkpoint folder, its converted files and transformers' model."""

    family: str
    folder: Path
    text: Path
    mmproj: Path
    mmproj_q8: Path
    mmproj_f16: Path
    reference: torch.nn.Module


def convert(folder: Path, *jobs: list[str]) -> None:
    """Run llama.cpp's converter on `folder` for each job (its other arguments)."""
    if not (CONVERTER / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not in {CONVERTER} (make setup-test puts it there)")
    jobs_json = json.dumps([[str(folder), *job] for job in jobs])
    done = subprocess.run(
        [sys.executable, "-c", RUN_CONVERTER, str(CONVERTER), jobs_json],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Callable[[str], Files]:
    """A family's Files, converted once per module whichever fixture asks."""
    done: dict[str, Files] = {}

    def build(family: str) -> Files:
        if family not in done:
            done[family] = build_files(family, tmp_path_factory.mktemp(family))
        return done[family]

    return build


def build_files(family: str, root: Path) -> Files:
    folder = root / "hf"
    folder.mkdir()
    text = dict(TEXT, vocab_size=VOCAB)
    reference = save_vl_checkpoint(folder, family, text, SPECIAL, GGUF_VISION[family])
    save_vl_tokenizer(folder, VL_TEMPLATE)
    preprocessor = {**PREPROCESSOR[family], **RELEASED_BUDGET[family]}
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    paths = {name: root / f"{name}.gguf" for name in ("text", "mmproj", "mmproj_q8", "mmproj_f16")}
    convert(
        folder,
        ["--outtype", "f32", "--outfile", str(paths["text"])],
        ["--mmproj", "--outtype", "f32", "--outfile", str(paths["mmproj"])],
        ["--mmproj", "--outtype", "q8_0", "--outfile", str(paths["mmproj_q8"])],
        ["--mmproj", "--outtype", "f16", "--outfile", str(paths["mmproj_f16"])],
    )
    return Files(family, folder, **paths, reference=reference)


@pytest.fixture(scope="module", params=FAMILIES)
def files(request, built) -> Files:
    return built(request.param)


@pytest.fixture(scope="module")
def qwen2_5_files(built) -> Files:
    return built("qwen2.5-vl")


@pytest.fixture(scope="module")
def qwen3_files(built) -> Files:
    return built("qwen3-vl")


def folder_logits(files: Files, p: ImagePrompt) -> torch.Tensor:
    """transformers' logits (L, vocab) (`test_vl_models.reference_logits`), the image
    preprocessed as the folder's preprocessor config says, not as the projector's."""
    folder = SimpleNamespace(settings=load_image_settings(files.folder))
    return reference_logits((folder, files.reference), p, IMAGE)


def test_logits_with_an_image_equal_transformers(files):
    vl = VisionLanguageModel.load(files.text, dtype="float32", mmproj=files.mmproj)
    p = image_prompt(vl, [PICTURE])
    ours = vl.prefill([p]).logits[0]
    expected = folder_logits(files, p)
    assert expected.abs().max() > 1  # logits of order 1
    print(f"{files.family}: max |difference| {(ours - expected).abs().max():.2e}")
    assert (ours - expected).abs().max() < TOLERANCE


def test_image_settings_read_from_the_projector_equal_the_folders(files):
    """The settings the file stores (patch and merge sizes, mean and std: as float32) are
    the folder's preprocessor config's, as the converter read them. The pixel budget is not
    in the file: it is qinfer's constant for the family (`mmproj.PROJECTORS`), here only
    held to the released configs' numbers as RELEASED_BUDGET copies them."""
    vl = VisionLanguageModel.load(files.text, dtype="float32", mmproj=files.mmproj)
    ours, folder = vl.settings, load_image_settings(files.folder)
    assert (ours.patch_size, ours.merge_size) == (folder.patch_size, folder.merge_size)
    assert torch.allclose(torch.tensor(ours.mean), torch.tensor(folder.mean), rtol=1e-7)
    assert torch.allclose(torch.tensor(ours.std), torch.tensor(folder.std), rtol=1e-7)
    assert (ours.min_pixels, ours.max_pixels) == (folder.min_pixels, folder.max_pixels)


def test_a_q8_0_projector_reads_its_blocks_as_gguf_dequantizes_them(files):
    """The converter's q8_0 projector holds Q8_0 and F16 tensors. Dequantized, they are the
    `gguf` package's values; kept as int8 blocks, the tower gives what the dequantized
    weights give; the logits stay within Q8_0's rounding of transformers' (measured:
    6.8e-2 Qwen2.5-VL, 3.7e-2 Qwen3-VL, logits of order 5)."""
    reader = gguf.GGUFReader(files.mmproj_q8)
    stored = {t.name: t for t in reader.tensors}
    assert (
        stored["mm.0.weight"].tensor_type.name,
        stored["v.blk.0.ffn_down.weight"].tensor_type.name,
    ) == ("Q8_0", "F16")
    vl = VisionLanguageModel.load(files.text, dtype="float32", mmproj=files.mmproj_q8)
    block = vl.encoder.blocks[0]
    down = block.down if hasattr(block, "down") else block.fc2  # Qwen2.5-VL's, Qwen3-VL's
    for name, linear in [("mm.0.weight", vl.encoder.merger.fc1), ("v.blk.0.ffn_down.weight", down)]:
        tensor = stored[name]
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert torch.equal(linear.weight, torch.from_numpy(expected).float())
    config = vl.model.config
    kept, _ = load_projector(files.mmproj_q8, files.text, config, torch.float32, "cpu", True)
    choose_paths(kept, exact=True)  # fp32 activations: only the weights could differ
    assert isinstance(vl.encoder.blocks[0].attn.qkv, DenseLinear)
    assert not isinstance(kept.blocks[0].attn.qkv, DenseLinear)
    p = image_prompt(vl, [PICTURE])
    patched = preprocess_images(p.images, vl.settings)
    with torch.no_grad():
        dense = vl.encoder(patched.pixel_values, patched.grids)
        blocks = kept(patched.pixel_values, patched.grids)
    dense, blocks = getattr(dense, "embeddings", dense), getattr(blocks, "embeddings", blocks)
    assert (dense - blocks).abs().max() < 1e-5
    difference = (vl.prefill([p]).logits[0] - folder_logits(files, p)).abs().max()
    print(f"{files.family} q8_0 projector: max |logit difference| {difference:.2e}")
    # not a check of the reading (the test below checks every tensor exactly): Q8_0's
    # rounding of the tower, carried into the logits, stays near what was measured
    assert difference < 0.15


def test_an_f16_projector_gives_transformers_logits_within_f16s_rounding(files):
    """The converter's f16 projector (F16 matrices, F32 norms and biases), dequantized to
    float32: transformers' logits (of order 5) within the rounding of the tower's weights
    to F16 (measured: 3.2e-3 Qwen2.5-VL, 1.5e-3 Qwen3-VL; the bound about three times
    the larger)."""
    types = {t.tensor_type.name for t in gguf.GGUFReader(files.mmproj_f16).tensors}
    assert types == {"F16", "F32"}
    vl = VisionLanguageModel.load(files.text, dtype="float32", mmproj=files.mmproj_f16)
    p = image_prompt(vl, [PICTURE])
    difference = (vl.prefill([p]).logits[0] - folder_logits(files, p)).abs().max()
    print(f"{files.family} f16 projector: max |logit difference| {difference:.2e}")
    assert difference < 1e-2


def test_every_tensor_of_a_q8_0_projector_reads_as_gguf_dequantizes_it(files):
    """Each stored tensor (Q8_0, F16, F32), read dequantized in float32 under its own
    name, equals the `gguf` package's dequantization exactly."""
    file = read_gguf(files.mmproj_q8)
    weights = ProjectorWeights(file, {t.name: t for t in file.tensors}, torch.float32, "cpu")
    reader = gguf.GGUFReader(files.mmproj_q8)
    assert {t.tensor_type.name for t in reader.tensors} == {"Q8_0", "F16", "F32"}
    for stored in reader.tensors:
        expected = torch.from_numpy(gguf.quants.dequantize(stored.data, stored.tensor_type).copy())
        ours = weights.tensor(stored.name)
        assert torch.equal(ours.reshape(expected.shape), expected.float()), stored.name


def test_generate_with_mmproj_equals_the_folder(files, tmp_path, capsys):
    """`qinfer generate --model model.gguf --mmproj mm.gguf --image x.png`: the greedy text
    of the checkpoint folder."""
    path = tmp_path / "x.png"
    PICTURE.save(path)
    flags = ["--image", str(path), "--max-tokens", "6", "--temperature", "0"]
    flags += ["--dtype", "float32", "--device", "cpu", "What is it?"]
    assert main(["generate", "--model", str(files.folder), *flags]) == 0
    expected = capsys.readouterr().out
    gguf_model = ["--model", str(files.text), "--mmproj", str(files.mmproj)]
    assert main(["generate", *gguf_model, *flags]) == 0
    assert capsys.readouterr().out == expected
    assert len(expected.strip()) > 0


def test_an_image_without_the_projector_is_refused_naming_mmproj(files, tmp_path, capsys):
    vl = VisionLanguageModel.load(files.text, dtype="float32")
    with pytest.raises(RequestError, match=r"^image 0 .*without its vision tower.*--mmproj FILE"):
        vl.prefill([ImagePrompt([START, IMAGE, END], [PICTURE])])
    path = tmp_path / "x.png"
    PICTURE.save(path)
    args = ["generate", "--model", str(files.text), "--image", str(path), "--device", "cpu", "Hi"]
    assert main(args) == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert line.startswith("qinfer: error: image 0 (") and "--mmproj FILE" in line


def test_the_server_answers_an_image_with_the_projector_as_the_folder(files):
    """`qinfer serve --model model.gguf --mmproj mm.gguf` (the real command, in a process of
    its own): a chat completion with an image (the real `openai` client) answers what
    `LLM.generate` answers on the folder."""
    command = ["--model", str(files.text), "--mmproj", str(files.mmproj)]
    command += ["--dtype", "float32", "--device", "cpu", "--served-model-name", MODEL]
    with serving(*command) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        answer = chat_image(client, data_url(png(PICTURE))).choices[0].message.content
    content = [{"type": "image", "image": PICTURE}, {"type": "text", "text": "What is it?"}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    llm = LLM(files.folder, dtype="float32")
    [expected] = llm.generate([[{"role": "user", "content": content}]], params, use_tqdm=False)
    assert answer == expected.text and answer


def rewritten(source: Path, target: Path, renamed: dict[str, str] | None = None, **changes) -> Path:
    """A copy of GGUF file `source` at `target` with some metadata values changed (keys with
    dots spelled with double underscores), of the same types; a key changed to None is left
    out, a key the file lacks is added (an integer, as uint32). `renamed`: tensors stored
    under other names."""
    reader = gguf.GGUFReader(source)
    changes = {key.replace("__", "."): value for key, value in changes.items()}
    writer = gguf.GGUFWriter(target, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in changes and changes[key] is None:
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, changes.get(key, field.contents()), kind, sub_type=sub_type)
    for key in changes.keys() - reader.fields.keys():
        writer.add_uint32(key, changes[key])
    for tensor in reader.tensors:
        name = (renamed or {}).get(tensor.name, tensor.name)
        writer.add_tensor(name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_an_unsupported_projector_type_is_refused_listing_the_supported(files, tmp_path):
    mmproj = rewritten(files.mmproj, tmp_path / "mm.gguf", clip__projector_type="gemma3")
    with pytest.raises(
        ConfigError,
        match=r"^.*mm\.gguf: projector type 'gemma3' is not supported; "
        r"supported: qwen2\.5vl_merger, qwen3vl_merger$",
    ):
        VisionLanguageModel.load(files.text, dtype="float32", mmproj=mmproj)


def test_a_projection_width_other_than_the_hidden_size_is_refused(files, tmp_path):
    mmproj = rewritten(files.mmproj, tmp_path / "mm.gguf", clip__vision__projection_dim=32)
    with pytest.raises(
        ConfigError,
        match=r"clip\.vision\.projection_dim is 32, but the text model .* hidden size 64$",
    ):
        VisionLanguageModel.load(files.text, dtype="float32", mmproj=mmproj)


def test_another_familys_projector_is_refused(files, tmp_path):
    other = {"qwen2.5-vl": "qwen3vl_merger", "qwen3-vl": "qwen2.5vl_merger"}[files.family]
    mmproj = rewritten(files.mmproj, tmp_path / "mm.gguf", clip__projector_type=other)
    with pytest.raises(ConfigError, match=r"projector; .*text\.gguf is not a Qwen.*text model"):
        VisionLanguageModel.load(files.text, dtype="float32", mmproj=mmproj)


def test_a_projector_with_a_text_only_model_is_refused(files, tmp_path):
    reference = build_checkpoint(tmp_path, "qwen3")
    model = write_gguf_model(reference, tmp_path / "qwen3.gguf", "qwen3")
    with pytest.raises(
        ConfigError, match=r"qwen3\.gguf is a text-only model \(model_type 'qwen3'\)$"
    ):
        VisionLanguageModel.load(model, dtype="float32", mmproj=files.mmproj)


def test_a_text_model_given_as_the_projector_is_refused(files):
    with pytest.raises(ConfigError, match=r"text\.gguf is not a projector \(mmproj\) file"):
        VisionLanguageModel.load(files.text, dtype="float32", mmproj=files.text)


def test_deepstack_counts_that_differ_are_refused(qwen3_files, tmp_path):
    stacked = [True, False, False]  # one feature; the text model adds two
    mmproj = rewritten(
        qwen3_files.mmproj, tmp_path / "mm.gguf", clip__vision__is_deepstack_layers=stacked
    )
    with pytest.raises(
        ConfigError, match=r"mm\.gguf gives 1 DeepStack features, but the text .* adds 2"
    ):
        VisionLanguageModel.load(qwen3_files.text, dtype="float32", mmproj=mmproj)


def test_mrope_sections_with_a_fourth_are_refused(files, tmp_path):
    arch = read_gguf(files.text).metadata["general.architecture"]
    changes = {f"{arch}__rope__dimension_sections": [2, 3, 2, 1]}
    model = rewritten(files.text, tmp_path / "text.gguf", **changes)
    with pytest.raises(ConfigError, match=rf"{arch}\.rope\.dimension_sections is \[2, 3, 2, 1\]"):
        VisionLanguageModel.load(model, dtype="float32")


def test_a_qwen2_5_vl_projector_without_its_window_pattern_is_refused(qwen2_5_files, tmp_path):
    """llama.cpp requires clip.vision.n_wa_pattern of a qwen2.5vl_merger file: without it,
    which blocks attend in windows is unknown."""
    source = qwen2_5_files.mmproj
    mmproj = rewritten(source, tmp_path / "mm.gguf", clip__vision__n_wa_pattern=None)
    with pytest.raises(
        ConfigError, match=r"^.*mm\.gguf: GGUF metadata clip\.vision\.n_wa_pattern is missing$"
    ):
        VisionLanguageModel.load(qwen2_5_files.text, dtype="float32", mmproj=mmproj)


def test_a_qwen2_5_vl_projector_with_ffn_up_and_down_swapped_reads_as_stored_right(
    qwen2_5_files, tmp_path
):
    """Older exports store a block's ffn_up under ffn_down's name and the reverse; as
    llama.cpp does, a ffn_down that takes the tower's width is read as the up projection:
    the logits are the correctly named file's, exactly."""
    source, depth = qwen2_5_files.mmproj, GGUF_VISION["qwen2.5-vl"]["depth"]
    swap = {}
    for i in range(depth):
        for suffix in ("weight", "bias"):
            up, down = f"v.blk.{i}.ffn_up.{suffix}", f"v.blk.{i}.ffn_down.{suffix}"
            swap |= {up: down, down: up}
    mmproj = rewritten(source, tmp_path / "mm.gguf", renamed=swap)
    stored = {t.name: t for t in gguf.GGUFReader(mmproj).tensors}
    assert stored["v.blk.0.ffn_down.weight"].shape[0] == GGUF_VISION["qwen2.5-vl"]["hidden_size"]
    expected = VisionLanguageModel.load(qwen2_5_files.text, dtype="float32", mmproj=source)
    vl = VisionLanguageModel.load(qwen2_5_files.text, dtype="float32", mmproj=mmproj)
    p = image_prompt(vl, [PICTURE])
    assert torch.equal(vl.prefill([p]).logits[0], expected.prefill([p]).logits[0])


def test_a_bad_tower_width_is_refused_naming_its_gguf_key_once_with_the_path(files, tmp_path):
    mmproj = rewritten(files.mmproj, tmp_path / "mm.gguf", clip__vision__embedding_length=0)
    with pytest.raises(
        ConfigError,
        match=r"^[^:]*mm\.gguf: GGUF metadata clip\.vision\.embedding_length must be a "
        r"positive integer$",
    ):
        VisionLanguageModel.load(files.text, dtype="float32", mmproj=mmproj)


def test_a_bad_image_mean_is_refused_naming_its_gguf_key_once_with_the_path(files, tmp_path):
    mmproj = rewritten(files.mmproj, tmp_path / "mm.gguf", clip__vision__image_mean=[0.5, 0.5])
    with pytest.raises(
        ConfigError,
        match=r"^[^:]*mm\.gguf: GGUF metadata clip\.vision\.image_mean must be 3 numbers$",
    ):
        VisionLanguageModel.load(files.text, dtype="float32", mmproj=mmproj)


@pytest.mark.parametrize("load", ["engine", "vision_language_model"])
def test_a_wrong_projector_is_refused_before_the_text_model_loads(
    files, tmp_path, monkeypatch, load
):
    """The projector's header and its pairing are checked from the files' headers: a
    wrong --mmproj fails without the text model's load (here made to fail loudly)."""
    import qinfer.engine.build
    import qinfer.vision.language_model

    def no_load(*args, **kwargs):
        raise AssertionError("the text model was loaded")

    monkeypatch.setattr(qinfer.engine.build, "load_model", no_load)
    monkeypatch.setattr(qinfer.vision.language_model, "load_model", no_load)
    mmproj = rewritten(files.mmproj, tmp_path / "mm.gguf", clip__vision__projection_dim=32)
    with pytest.raises(ConfigError, match=r"clip\.vision\.projection_dim is 32"):
        if load == "engine":
            LLM(files.text, dtype="float32", mmproj=mmproj)
        else:
            VisionLanguageModel.load(files.text, dtype="float32", mmproj=mmproj)


def test_a_qwen2_5_vl_projectors_window_size_is_not_read(qwen2_5_files, tmp_path):
    """llama.cpp ignores clip.vision.window_size for qwen2.5vl_merger (112 pixels, fixed):
    a file that says 56 windows 112 pixels."""
    source = qwen2_5_files.mmproj
    mmproj = rewritten(source, tmp_path / "mm.gguf", clip__vision__window_size=56)
    assert gguf.GGUFReader(mmproj).fields["clip.vision.window_size"].contents() == 56
    vl = VisionLanguageModel.load(qwen2_5_files.text, dtype="float32", mmproj=mmproj)
    assert vl.encoder.config.window_size == 112


def test_the_patch_kernel_is_read_whole_and_a_slice_of_it_is_refused(files):
    file = read_gguf(files.mmproj)
    stored = {t.name: t for t in file.tensors}
    tensors = {PATCH_EMBED + n.removeprefix(PATCH_FRAMES[0]): stored[n] for n in PATCH_FRAMES}
    weights = ProjectorWeights(file, tensors, torch.float32, "cpu")
    hidden = GGUF_VISION[files.family]["hidden_size"]
    assert weights.tensor(PATCH_EMBED).shape[:3] == (hidden, 3, 2)
    with pytest.raises(
        WeightsError, match=r"mm.*\.gguf: visual\.patch_embed\.proj\.weight is read whole"
    ):
        weights.tensor(PATCH_EMBED, rows=slice(0, 4))


def test_a_q8_0_projectors_kept_blocks_at_the_default_dtype_answer_as_float32(files):
    """`LLM(model.gguf, mmproj=q8_0.gguf)` at the default dtype keeps the tower's Q8_0
    blocks (the int8 kernels); an image gives the greedy tokens of the float32 path, whose
    tower is dequantized, and image embeddings within 1e-5 of its (of order 2; measured on
    CPU: 1.4e-6 Qwen2.5-VL, 1.9e-6 Qwen3-VL)."""
    content = [{"type": "image", "image": PICTURE}, {"type": "text", "text": "What is it?"}]
    chat = [[{"role": "user", "content": content}]]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    runs = {}
    for dtype in (None, "float32"):
        # exact: the kept blocks meet fp32 activations, as the dequantized tower's do
        llm = LLM(files.text, dtype=dtype, device="cpu", mmproj=files.mmproj_q8, exact=True)
        vision = llm.engine.vision
        [out] = llm.generate(chat, params, use_tqdm=False)
        runs[dtype] = (vision, out.token_ids)
    (kept, kept_ids), (dense, dense_ids) = runs[None], runs["float32"]
    assert not isinstance(kept.encoder.blocks[0].attn.qkv, DenseLinear)
    assert isinstance(dense.encoder.blocks[0].attn.qkv, DenseLinear)
    assert list(kept_ids) == list(dense_ids) and len(kept_ids) > 0
    ours, expected = kept.encode([PICTURE]).embeddings, dense.encode([PICTURE]).embeddings
    print(
        f"{files.family}: kept q8_0 tower, max |embedding difference| "
        f"{(ours.float() - expected).abs().max():.2e} of {expected.abs().max():.2e}"
    )
    assert (ours.float() - expected).abs().max() < 1e-5

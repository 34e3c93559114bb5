"""Prompts with images through the engine (qinfer.engine.images, the runner's
`ForwardBatch.images`, the prefix cache's image keys, `qinfer generate/chat --image`):
greedy tokens against the offline VisionLanguageModel (tests/test_vl_models.py checks it
against transformers) and transformers' generate, on tiny random Qwen2.5-VL and Qwen3-VL
checkpoints with a byte-level tokenizer and a Qwen-VL chat template."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import CHATML_TEMPLATE, build_checkpoint, build_tokenizer
from test_vl_models import TEXT, VISION, make_image, save_vl_checkpoint
from tokenizers import Tokenizer

from qinfer import LLM, SamplingParams
from qinfer.cli import main
from qinfer.core.errors import RequestError
from qinfer.vision import ImagePrompt, VisionLanguageModel, preprocess_images

#: build_tokenizer's 261 ids (bytes, ChatML, <think>), then Qwen-VL's vision tokens.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
START, END, IMAGE = 261, 262, 263
SPECIAL = dict(
    vision_start_token_id=START, vision_end_token_id=END, image_token_id=IMAGE, video_token_id=264
)
VOCAB = 272

#: ChatML whose user content may be a list of parts, an image part written as Qwen-VL's
#: templates write it.
VL_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- else %}{{ part['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
#: A small pool of small blocks: an image's tokens fill several blocks.
ENGINE = dict(block_size=4, num_kv_blocks=96, dtype="float32")

#: 112 x 84 and 56 x 112 pixels: 12 and 8 tokens (Qwen2.5-VL), 9 and 6 (Qwen3-VL).
IMAGES = [make_image(112, 84, 0), make_image(56, 112, 1), make_image(112, 84, 2)]


def save_vl_tokenizer(folder, template: str) -> None:
    """build_tokenizer's tokenizer with the vision tokens added, and `template`."""
    build_tokenizer(folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens(VISION_TOKENS)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module", params=list(VISION))
def checkpoint(request, tmp_path_factory):
    """(folder, transformers' model) of one family's random checkpoint with a tokenizer."""
    folder = tmp_path_factory.mktemp(request.param)
    reference = save_vl_checkpoint(folder, request.param, dict(TEXT, vocab_size=VOCAB), SPECIAL)
    save_vl_tokenizer(folder, VL_TEMPLATE)
    return folder, reference


@pytest.fixture(scope="module")
def vl(checkpoint):
    return VisionLanguageModel.load(checkpoint[0], dtype="float32")


def make_llm(vl, **engine_args) -> LLM:
    return LLM(vl, **{**ENGINE, **engine_args})


def image_prompt(vl, images, before=(5, 6), after=(7, 8, 9)) -> ImagePrompt:
    """Text ids, each image's whole run of tokens, more text ids."""
    ids = list(before)
    for t, h, w in preprocess_images(images, vl.settings).grids:
        ids += [START, *[IMAGE] * (t * h * w // 4), END]
    return ImagePrompt([*ids, *after], images)


def offline_greedy(vl, p: ImagePrompt, n: int) -> list[int]:
    """n greedy tokens of the offline model: prefill, then one decode step per token."""
    state = vl.prefill([p], max_length=len(p.token_ids) + n)
    tokens = [int(state.logits[0, -1].argmax())]
    while len(tokens) < n:
        tokens.append(int(vl.decode(state, torch.tensor([[tokens[-1]]]))[0, -1].argmax()))
    return tokens


def test_greedy_tokens_with_an_image_equal_the_offline_model_and_transformers(checkpoint, vl):
    p = image_prompt(vl, IMAGES[:1])
    [out] = make_llm(vl).generate(p, GREEDY, use_tqdm=False)
    assert out.token_ids == offline_greedy(vl, p, GREEDY.max_tokens)
    patched = preprocess_images(p.images, vl.settings)
    ids = torch.tensor([list(p.token_ids)])
    with torch.no_grad():
        generated = checkpoint[1].generate(
            input_ids=ids,
            pixel_values=patched.pixel_values,
            image_grid_thw=torch.tensor(patched.grids),
            mm_token_type_ids=(ids == IMAGE).int(),
            max_new_tokens=GREEDY.max_tokens,
            do_sample=False,
        )
    assert out.token_ids == generated[0, ids.shape[1] :].tolist()


def test_a_chat_image_part_becomes_its_run_of_tokens_with_either_template(checkpoint, vl, tmp_path):
    """The VL template writes the placeholder; a template of text only gets it in the
    message's text: the same ids, whose tokens are the ImagePrompt's of those ids."""
    path = tmp_path / "cat.png"
    IMAGES[0].save(path)
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": str(path)}, {"type": "text", "text": "Hi"}],
        }
    ]
    folder = checkpoint[0]
    [out] = LLM(folder, **ENGINE).generate(messages, GREEDY, use_tqdm=False)
    save_vl_tokenizer(tmp_path, CHATML_TEMPLATE)
    [plain] = LLM(folder, tmp_path, **ENGINE).generate(messages, GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == plain.prompt_token_ids
    assert out.prompt_token_ids.count(IMAGE) == len(image_prompt(vl, IMAGES[:1]).token_ids) - 7
    direct = ImagePrompt(out.prompt_token_ids, [IMAGES[0]])
    assert out.token_ids == plain.token_ids == offline_greedy(vl, direct, GREEDY.max_tokens)


def test_requests_with_different_images_batched_equal_each_alone(vl):
    prompts = [image_prompt(vl, IMAGES[:1]), image_prompt(vl, IMAGES[1:2], before=(9,))]
    prompts.append(ImagePrompt([3, 14, 15, 92, 65]))  # text beside them
    llm = make_llm(vl)
    batched = llm.generate(prompts, GREEDY, use_tqdm=False)
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert batched[0].token_ids != batched[1].token_ids


def test_chunked_prefill_that_splits_images_equals_one_prefill(vl):
    p = image_prompt(vl, IMAGES[:2])
    whole = make_llm(vl, enable_prefix_caching=False).generate(p, GREEDY, use_tqdm=False)
    chunked = make_llm(vl, max_num_batched_tokens=5, max_num_seqs=4, enable_prefix_caching=False)
    assert chunked.generate(p, GREEDY, use_tqdm=False)[0].token_ids == whole[0].token_ids
    assert chunked.engine.stats().images_encoded_total == 2  # once, for every chunk


def test_a_repeated_image_is_a_prefix_cache_hit_and_another_image_is_not(vl):
    """A conversation's next turn repeats its image: the blocks through it are cached. The
    same ids with another image's pixels hit only the blocks before the image, and its
    first token's logprobs differ."""
    llm = make_llm(vl)
    params = GREEDY.replace(logprobs=3)
    first = image_prompt(vl, IMAGES[:1])
    [out] = llm.generate(first, params, use_tqdm=False)
    turn = ImagePrompt([*first.token_ids, *out.token_ids, 40, 41, 42], first.images)
    [again] = llm.generate(turn, params, use_tqdm=False)
    image_end = list(first.token_ids).index(END)
    assert again.num_cached_tokens > image_end
    other = ImagePrompt(first.token_ids, [IMAGES[2]])  # 112 x 84 too: the same ids
    assert other.token_ids == image_prompt(vl, IMAGES[2:]).token_ids
    [changed] = llm.generate(other, params, use_tqdm=False)
    block = ENGINE["block_size"]
    assert changed.num_cached_tokens == list(first.token_ids).index(IMAGE) // block * block
    assert changed.logprobs[0].top_logprobs != out.logprobs[0].top_logprobs
    assert changed.token_ids == offline_greedy(vl, other, GREEDY.max_tokens)


def test_preemption_in_a_tiny_pool_keeps_the_tokens_and_encodes_again(vl):
    prompts = [image_prompt(vl, [image], before=(b,)) for b, image in enumerate(IMAGES)]
    params = GREEDY.replace(max_tokens=12)
    expected = [o.token_ids for o in make_llm(vl).generate(prompts, params, use_tqdm=False)]
    tiny = make_llm(vl, num_kv_blocks=12, enable_prefix_caching=False)
    outputs = tiny.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    stats = tiny.engine.stats()
    assert stats.preemptions_total > 0
    assert stats.images_encoded_total > len(IMAGES)  # a recomputed prompt encodes again
    assert stats.vision_encoder_seconds_total > 0


def test_a_file_that_is_not_an_image_is_refused_naming_it(vl, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not an image")
    with pytest.raises(RequestError, match=r"^image 0 \(.*notes\.txt\)") as error:
        make_llm(vl).generate(ImagePrompt([1, 2], [path]), GREEDY, use_tqdm=False)
    assert "\n" not in str(error.value)


def test_an_image_sent_to_a_text_only_model_is_refused_naming_it(tmp_path):
    build_checkpoint(tmp_path, "qwen3", vocab_size=VOCAB)
    save_vl_tokenizer(tmp_path, VL_TEMPLATE)
    path = tmp_path / "cat.png"
    IMAGES[0].save(path)
    messages = [{"role": "user", "content": [{"type": "image", "image": path}]}]
    with pytest.raises(
        RequestError, match=r"^image 0 \(.*cat\.png\) was sent to model_type 'qwen3', a text-only"
    ):
        LLM(tmp_path, **ENGINE).generate(messages, GREEDY, use_tqdm=False)


def test_generate_and_chat_take_an_image(checkpoint, vl, tmp_path, capsys, monkeypatch):
    import io

    path = tmp_path / "cat.png"
    IMAGES[0].save(path)
    flags = ["--model", str(checkpoint[0]), "--image", str(path), "--max-tokens", "4"]
    flags += ["--temperature", "0", "--dtype", "float32", "--device", "cpu"]
    assert main(["generate", *flags, "Hi"]) == 0
    shown = capsys.readouterr()
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": path}, {"type": "text", "text": "Hi"}],
        }
    ]
    llm = LLM(vl, checkpoint[0], **ENGINE)
    [expected] = llm.generate(messages, GREEDY.replace(max_tokens=4), use_tqdm=False)
    assert shown.out == expected.text + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nMore\n"))
    assert main(["chat", *flags]) == 0
    assert capsys.readouterr().err.count("prompt tokens") == 2


@pytest.mark.parametrize(
    "make, names",
    [
        (lambda folder, tmp: (folder, tmp / "notes.txt"), "notes.txt"),
        (lambda folder, tmp: (tmp, tmp / "cat.png"), "cat.png) was sent to model_type 'qwen3'"),
    ],
    ids=["not an image", "text-only model"],
)
def test_a_bad_image_flag_is_one_line_and_exit_2(checkpoint, tmp_path, capsys, make, names):
    (tmp_path / "notes.txt").write_text("not an image")
    IMAGES[0].save(tmp_path / "cat.png")
    build_checkpoint(tmp_path, "qwen3", vocab_size=VOCAB)
    save_vl_tokenizer(tmp_path, VL_TEMPLATE)
    model, image = make(checkpoint[0], tmp_path)
    args = ["generate", "--model", str(model), "--image", str(image), "--device", "cpu", "Hi"]
    assert main(args) == 2
    err = capsys.readouterr().err  # the load's announcement, then the error's one line
    [line] = [line for line in err.splitlines() if "error" in line]
    assert line.startswith("qinfer: error: image 0 (") and names in line

"""Reasoning split: `<think>` blocks separated from answers, whole or streamed.

The reference for where reasoning ends and the answer begins is Qwen3's own chat template:
it parses an assistant message's `<think>` block when it renders history, so a split is
right when rendering (reasoning_content, content) gives the same prompt as the raw text.
"""

import random

import pytest
from text_assets import QWEN3_CHAT_TEMPLATE

from qinfer.text.chat_template import render_chat_template
from qinfer.text.reasoning import ReasoningStream, prompt_opened_think, split_reasoning

MODEL_OPENS_THINK = [
    "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello! How can I help?",
    "<think>\n\n</think>\n\nNo thinking needed.",
    "<think>short</think>answer",
    "<think>\nuses </thin and < signs\n\n</think>\n\n\nthe answer\n\nwith lines\n",
]
NO_THINK = ["Just an answer.", "  indented answer <think> later is text", ""]


def render_as_history(assistant: dict) -> str:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", **assistant}]
    return render_chat_template(QWEN3_CHAT_TEMPLATE, messages, add_generation_prompt=False)


@pytest.mark.parametrize("text", MODEL_OPENS_THINK)
def test_split_agrees_with_how_qwen3_reads_its_own_output(text):
    reasoning, answer = split_reasoning(text)
    separated = render_as_history({"content": answer, "reasoning_content": reasoning})
    assert separated == render_as_history({"content": text})


@pytest.mark.parametrize("text", MODEL_OPENS_THINK)
def test_text_starting_inside_an_opened_block_splits_the_same(text):
    continued = text.removeprefix("<think>")
    assert split_reasoning(continued, prompt_opened_think=True) == split_reasoning(text)


@pytest.mark.parametrize("text", NO_THINK)
def test_text_without_a_think_block_is_all_answer(text):
    assert split_reasoning(text) == ("", text)


def test_unclosed_block_is_all_reasoning():
    assert split_reasoning("<think>\nstill thinking\n") == ("still thinking", "")
    assert split_reasoning("still thinking", prompt_opened_think=True) == ("still thinking", "")


def test_prompt_opened_think_detects_an_open_block():
    assert prompt_opened_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opened_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opened_think("<|im_start|>assistant\n")


def test_enable_thinking_false_prompt_leaves_no_open_block():
    prompt = render_chat_template(
        QWEN3_CHAT_TEMPLATE, [{"role": "user", "content": "hi"}], enable_thinking=False
    )
    assert prompt.endswith("</think>\n\n") and not prompt_opened_think(prompt)


def chunkings(text: str):
    """The text cut into single characters, and into random pieces (fixed seeds)."""
    yield list(text)
    for seed in range(5):
        rng, pieces, start = random.Random(seed), [], 0
        while start < len(text):
            end = start + rng.randint(1, 6)
            pieces.append(text[start:end])
            start = end
        yield pieces


@pytest.mark.parametrize("opened", [False, True])
@pytest.mark.parametrize("text", MODEL_OPENS_THINK + NO_THINK)
def test_streamed_deltas_add_up_to_the_split(text, opened):
    if opened:
        text = text.removeprefix("<think>")
    expected = split_reasoning(text, prompt_opened_think=opened)
    for pieces in chunkings(text):
        stream = ReasoningStream(prompt_opened_think=opened)
        deltas = [stream.push(piece) for piece in pieces] + [stream.finish()]
        reasoning = "".join(r for r, _ in deltas)
        answer = "".join(a for _, a in deltas)
        assert (reasoning, answer) == expected, pieces


def test_stream_sends_reasoning_before_the_block_closes():
    stream = ReasoningStream()
    assert stream.push("<think>\nfirst ") == ("first ", "")
    assert stream.push("thought\n</th") == ("thought", "")
    assert stream.push("ink>\n\nHi") == ("", "Hi")

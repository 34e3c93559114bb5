"""Generation: greedy output equals transformers' generate, alone and batched; streaming,
stop strings, EOS and context limits behave as engine/generation.py's docstring says.

The references: `transformers`' `generate(do_sample=False)` on the same random checkpoint
for token ids, and, for the text-level checks, a model forced to say a known script.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import build_chat_checkpoint

import qinfer
from qinfer import SamplingParams, generate, stream_generate
from qinfer.core.errors import QinferError

FAMILIES = ["qwen3", "llama", "qwen2"]
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = ["Hi", "The capital of France is", "one two three four five six"]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(transformers model, qinfer model, tokenizer) of one random checkpoint per family."""
    folder = tmp_path_factory.mktemp(request.param)
    reference = build_chat_checkpoint(folder, request.param)
    model = qinfer.load_model(folder, dtype=torch.float32, device="cpu")
    return reference, model, qinfer.load_tokenizer(folder)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(qinfer model, tokenizer, transformers model) of a random Qwen3 with a short context."""
    folder = tmp_path_factory.mktemp("qwen3-short")
    reference = build_chat_checkpoint(folder, "qwen3", max_position_embeddings=64)
    model = qinfer.load_model(folder, dtype=torch.float32, device="cpu")
    return model, qinfer.load_tokenizer(folder), reference


def reference_greedy(reference, ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt, EOS suppressed."""
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


class Scripted:
    """A real model whose logits are replaced so that it says `script`, one token per
    forward: text-level behaviour checked against an output known in advance."""

    def __init__(self, model, script: list[int]):
        self.model, self.script, self.steps = model, script, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def compute_logits(self, hidden):  # every step's sampled rows: (R, V)
        """The model's logits (its KV ran as usual) replaced by the script's next token."""
        logits = self.model.compute_logits(hidden)
        if not len(logits):  # a prompt chunk that samples nothing
            return logits
        forced = torch.full_like(logits, -1e4)
        forced[:, self.script[self.steps]] = 0.0
        self.steps += 1
        return forced


def scripted(qwen3, text: str, *extra_ids: int) -> Scripted:
    model, tokenizer, _ = qwen3
    return Scripted(model, tokenizer.encode(text, add_special_tokens=False) + list(extra_ids))


# --- token ids against transformers ------------------------------------------------------


def test_greedy_generation_matches_transformers(pair):
    reference, model, tokenizer = pair
    result = generate(model, tokenizer, PROMPTS[1], GREEDY)
    expected = reference_greedy(reference, tokenizer.encode(PROMPTS[1]))
    assert result.token_ids == expected
    assert (result.finish_reason, result.generated_tokens) == ("length", NEW_TOKENS)


def test_batched_rows_of_different_lengths_each_match_transformers_alone(pair):
    reference, model, tokenizer = pair
    results = generate(model, tokenizer, PROMPTS, GREEDY)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.token_ids == reference_greedy(reference, tokenizer.encode(prompt)), prompt


def test_rows_that_finish_early_leave_the_batch(qwen3):
    model, tokenizer, reference = qwen3
    rows_per_forward = []

    class Counting(Scripted):
        def compute_logits(self, hidden):
            rows_per_forward.append(hidden.shape[0])
            return self.model.compute_logits(hidden)

    lengths = [3, 12, 6]
    params = [GREEDY.replace(max_tokens=n) for n in lengths]
    results = generate(Counting(model, []), tokenizer, PROMPTS, params)
    assert rows_per_forward == [3, 3, 3, 2, 2, 2] + [1] * 6  # prefill + 11 decode steps
    for prompt, n, result in zip(PROMPTS, lengths, results, strict=True):
        assert result.token_ids == reference_greedy(reference, tokenizer.encode(prompt), n)


def test_chat_messages_go_through_the_template_with_its_options(qwen3):
    model, tokenizer, reference = qwen3
    messages = [{"role": "user", "content": "Hello"}]
    rendered = tokenizer.apply_chat_template(messages, enable_thinking=False)
    assert rendered != tokenizer.apply_chat_template(messages)  # the option matters
    result = generate(
        model, tokenizer, messages, GREEDY.replace(max_tokens=8), enable_thinking=False
    )
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert result.prompt_tokens == len(ids)
    assert result.token_ids == reference_greedy(reference, ids, 8)


def test_a_string_with_chat_true_is_one_user_message(qwen3):
    model, tokenizer, _ = qwen3
    params = GREEDY.replace(max_tokens=4)
    as_chat = generate(model, tokenizer, "Hello", params, chat=True)
    as_messages = generate(model, tokenizer, [{"role": "user", "content": "Hello"}], params)
    assert as_chat.token_ids == as_messages.token_ids
    assert as_chat.prompt_tokens == as_messages.prompt_tokens > len(tokenizer.encode("Hello"))


# --- text: streaming, stop strings, end of sequence --------------------------------------


def test_streamed_deltas_join_to_the_final_text(qwen3):
    model, tokenizer, _ = qwen3
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    stream = stream_generate(model, tokenizer, "Once upon a time", sampled)
    deltas = list(stream)
    assert "".join(deltas) == stream.result.text
    assert stream.result.text == tokenizer.decode(stream.result.token_ids, skip_special_tokens=True)


def test_streaming_never_splits_a_utf8_character(qwen3):
    text = "héllo 世界 🙂!"  # byte tokens: é is 2 tokens, 世 3, 🙂 4
    model = scripted(qwen3, text)
    stream = stream_generate(
        model, qwen3[1], "Say it", GREEDY.replace(max_tokens=len(model.script))
    )
    deltas = list(stream)
    assert "".join(deltas) == text
    assert not any("\ufffd" in delta for delta in deltas)
    assert stream.result.finish_reason == "length"


def test_a_stop_string_straddling_tokens_ends_the_text_and_is_cut(qwen3):
    model = scripted(qwen3, "Paris is nice. STOP and more text")
    params = GREEDY.replace(stop=["STOP"], max_tokens=len(model.script))
    stream = stream_generate(model, qwen3[1], "Say it", params)
    deltas = list(stream)
    assert stream.result.text == "".join(deltas) == "Paris is nice. "
    assert stream.result.finish_reason == "stop"
    assert stream.result.generated_tokens == len("Paris is nice. STOP")  # one token a byte


def test_eos_ends_the_row_and_stays_out_of_the_text(qwen3):
    model, tokenizer, _ = qwen3
    eos = tokenizer.token_to_id("<|im_end|>")
    result = generate(
        scripted(qwen3, "Done.", eos, 65, 66), tokenizer, "Hi", GREEDY.replace(ignore_eos=False)
    )
    assert (result.text, result.finish_reason) == ("Done.", "eos")
    assert result.token_ids[-1] == eos


def test_ignore_eos_generates_past_eos(qwen3):
    model, tokenizer, _ = qwen3
    eos = tokenizer.token_to_id("<|im_end|>")
    script = scripted(qwen3, "A", eos, *tokenizer.encode("B", add_special_tokens=False))
    result = generate(script, tokenizer, "Hi", GREEDY.replace(max_tokens=3))
    assert (result.text, result.finish_reason) == ("AB", "length")


def test_stop_token_ids_end_the_row_with_reason_stop(qwen3):
    model, tokenizer, _ = qwen3
    stop_id = tokenizer.encode("!", add_special_tokens=False)[0]
    params = GREEDY.replace(stop_token_ids=[stop_id])
    result = generate(scripted(qwen3, "Wow! more"), tokenizer, "Hi", params)
    assert (result.text, result.finish_reason) == ("Wow", "stop")


def test_reasoning_and_answer_are_split_for_a_thinking_vocabulary(qwen3):
    model = scripted(qwen3, "<think>\nLet me see.\n</think>\n\nParis.")
    result = generate(model, qwen3[1], "Capital?", GREEDY.replace(max_tokens=len(model.script)))
    assert (result.reasoning, result.answer) == ("Let me see.", "Paris.")


# --- limits and bad input ----------------------------------------------------------------


def test_max_tokens_is_cut_to_the_room_left_in_the_context(qwen3):
    model, tokenizer, _ = qwen3  # a context of 64 positions
    prompt = "x" * 50  # 50 byte tokens
    result = generate(model, tokenizer, prompt, GREEDY.replace(max_tokens=100))
    assert (result.generated_tokens, result.finish_reason) == (64 - 50, "length")


def test_a_prompt_that_fills_the_context_is_a_clear_error(qwen3):
    model, tokenizer, _ = qwen3
    with pytest.raises(QinferError, match="context"):
        generate(model, tokenizer, "x" * 64, GREEDY)


@pytest.mark.parametrize("prompt", ["", [], [["not a message"]]], ids=["text", "messages", "bad"])
def test_an_empty_or_malformed_prompt_is_a_clear_error(qwen3, prompt):
    model, tokenizer, _ = qwen3
    with pytest.raises(QinferError, match="prompt|messages"):
        generate(model, tokenizer, prompt, GREEDY)


def test_stream_generate_checks_the_prompt_before_streaming(qwen3):
    model, tokenizer, _ = qwen3
    with pytest.raises(QinferError, match="empty"):
        stream_generate(model, tokenizer, "", GREEDY)


def test_one_params_per_prompt_is_enforced(qwen3):
    model, tokenizer, _ = qwen3
    with pytest.raises(QinferError, match="SamplingParams"):
        generate(model, tokenizer, PROMPTS, [GREEDY, GREEDY])


def test_a_stream_is_read_once(qwen3):
    model, tokenizer, _ = qwen3
    stream = stream_generate(model, tokenizer, "Hi", GREEDY.replace(max_tokens=2))
    list(stream)
    with pytest.raises(QinferError, match="once"):
        list(stream)


def test_token_ids_are_a_prompt_as_for_the_engine(qwen3):
    model, tokenizer, _ = qwen3
    ids = tokenizer.encode("The capital of France is")
    by_text = generate(model, tokenizer, "The capital of France is", GREEDY.replace(max_tokens=6))
    by_ids = generate(model, tokenizer, ids, GREEDY.replace(max_tokens=6))
    assert by_ids.token_ids == by_text.token_ids and by_ids.text == by_text.text
    batch = generate(model, tokenizer, [ids, "Hi"], GREEDY.replace(max_tokens=6))
    assert batch[0].token_ids == by_text.token_ids
    with pytest.raises(QinferError, match="outside the vocabulary"):
        generate(model, tokenizer, [1, model.config.vocab_size], GREEDY)

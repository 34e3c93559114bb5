"""Streaming detokenizer: the deltas add up to the full decode, characters arrive whole,
stop strings are trimmed even across tokens, and each push decodes only a short window."""

import json

import pytest
import tokenizers
from text_assets import CHATML_SPECIAL, CORPUS, train_tokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

import qinfer
from qinfer.text.detokenizer import IncrementalDetokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Emoji 🦊🌧️ and 猫 are several byte tokens each; 👩‍👩‍👧 is a family.",
    "  spaces  and\nnewlines\n\n  kept ",
    "你好，世界。猫！",
]


@pytest.fixture(scope="module")
def byte_level():
    return qinfer.Tokenizer(train_tokenizer(CHATML_SPECIAL), eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def metaspace():
    """SentencePiece-style (Llama 2, Mistral): "▁" marks spaces, the decoder drops the first
    one, and characters outside the vocabulary fall back to <0xNN> byte tokens."""
    backend = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence(
        [decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    # Byte tokens are ordinary vocabulary entries (not special) in SentencePiece models.
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    return qinfer.Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec)), eos_token="</s>")


def stream(tokenizer, ids, **kwargs):
    """(deltas, detokenizer) after pushing every id and finishing."""
    detokenizer = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas = [detokenizer.push(i) for i in ids]
    deltas.append(detokenizer.finish())
    return deltas, detokenizer


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_the_full_decode(request, kind, text):
    tokenizer = request.getfixturevalue(kind)
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, detokenizer = stream(tokenizer, ids)
    assert "".join(deltas) == detokenizer.text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_multi_byte_characters_come_out_whole(request, kind):
    tokenizer = request.getfixturevalue(kind)
    ids = tokenizer.encode("a🦊b猫", add_special_tokens=False)
    assert len(ids) >= 8  # the fox and the cat are split into byte tokens
    deltas, _ = stream(tokenizer, ids)
    assert [d for d in deltas if d] == ["a", "🦊", "b", "猫"]


def test_unfinished_character_is_flushed_at_the_end(byte_level):
    ids = byte_level.encode("ok🦊", add_special_tokens=False)[:-1]  # the fox loses its last byte
    deltas, _ = stream(byte_level, ids)
    assert "\ufffd" not in "".join(deltas[:-1])
    assert "".join(deltas) == byte_level.decode(ids)


def test_stop_string_across_tokens_is_trimmed_and_ends_the_text(byte_level):
    text = "Answer: 42. The reasoning is simple."
    ids = byte_level.encode(text, add_special_tokens=False)
    pieces = [byte_level.decode([i]) for i in ids]
    assert not any(". The" in piece for piece in pieces)  # the stop string spans tokens
    deltas, detokenizer = stream(byte_level, ids, stop=[". The"])
    assert "".join(deltas) == detokenizer.text == "Answer: 42"
    assert detokenizer.stopped and detokenizer.matched_stop == ". The"


def test_nothing_is_emitted_after_a_stop(byte_level):
    ids = byte_level.encode("one STOP two three", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(byte_level, stop=["STOP"])
    emitted, after_stop = [], []
    for token_id in ids:
        (after_stop if detokenizer.stopped else emitted).append(detokenizer.push(token_id))
    assert detokenizer.stopped and "".join(emitted) == "one "
    assert after_stop and all(delta == "" for delta in after_stop)
    assert detokenizer.finish() == "" and detokenizer.text == "one "


def test_earliest_stop_string_wins(byte_level):
    ids = byte_level.encode("alpha beta gamma", add_special_tokens=False)
    deltas, detokenizer = stream(byte_level, ids, stop=["gamma", "beta"])
    assert "".join(deltas) == "alpha " and detokenizer.matched_stop == "beta"


def test_possible_start_of_a_stop_string_is_held_until_it_cannot_be(byte_level):
    ids = byte_level.encode("Hello ##", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(byte_level, stop=["###"])
    emitted = "".join(detokenizer.push(i) for i in ids)
    assert emitted == "Hello " and not detokenizer.stopped
    assert detokenizer.finish() == "##"


def test_special_tokens_are_skipped_unless_asked(byte_level):
    ids = byte_level.encode("Hi<|im_end|>", add_special_tokens=False)
    assert "".join(stream(byte_level, ids)[0]) == "Hi"
    kept = stream(byte_level, ids, skip_special_tokens=False)[0]
    assert "".join(kept) == "Hi<|im_end|>"


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call was given."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.window_sizes = []

    def decode(self, ids, skip_special_tokens=False):
        self.window_sizes.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens)


def test_each_push_decodes_a_short_window_not_the_whole_text(byte_level):
    ids = byte_level.encode(" ".join(TEXTS * 10), add_special_tokens=False)
    counting = CountingTokenizer(byte_level)
    deltas, _ = stream(counting, ids)
    assert len(ids) > 300
    assert max(counting.window_sizes) <= 8  # the longest character here is 7 byte tokens
    assert "".join(deltas) == byte_level.decode(ids)


def test_stop_string_completed_by_the_final_flush_is_still_trimmed(byte_level):
    ids = byte_level.encode("see 🦊 run", add_special_tokens=False)
    fox_end = next(n for n in range(len(ids)) if byte_level.decode(ids[:n]).endswith("🦊"))
    deltas, detokenizer = stream(byte_level, ids[: fox_end - 1], stop=["e \ufffd"])
    assert "".join(deltas) == "se" and detokenizer.matched_stop == "e \ufffd"

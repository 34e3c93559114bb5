"""Tokenizers built from GGUF metadata, against `transformers`' tokenizer of the same file
(byte-level BPE) and against `sentencepiece` itself (SentencePiece BPE)."""

import copy

import pytest
from gguf_files import smollm2_path, write_gguf

import qinfer
from qinfer.core.errors import TokenizerError
from qinfer.weights.gguf_file import read_gguf
from qinfer.weights.gguf_tokenizer import tokenizer_from_gguf

CORPUS = [
    "Hello, world! How are you today?",
    "def add(a, b):\n    return a + b  # sum\n\n\nclass X:\n\tpass\n",
    "日本語のテキストと中文，还有한국어.",
    "emoji 🤖🎉👍🏽 and flags 🇫🇷 done",
    "   leading, inner    runs and trailing spaces   ",
    "tabs\tand\r\nwindows newlines\n\n\n",
    "numbers 12345, 3.14159 and 2024-01-01; 1,000,000",
    "I'm sure they'll say we've DONE it, aren't you? He'd",
    "ünïcödé Ωμέγα русский текст ™ ﬁ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b<repo_name>c <file_sep> d",
    "",
]


@pytest.fixture(scope="module")
def smollm2_tokenizers(smollm2_hf_tokenizer):
    """(ours, transformers') tokenizer of the embedded SmolLM2 GGUF."""
    return qinfer.load_tokenizer(smollm2_path()), smollm2_hf_tokenizer


@pytest.mark.parametrize("text", CORPUS)
def test_smollm2_encodes_like_transformers(smollm2_tokenizers, text):
    ours, reference = smollm2_tokenizers
    assert ours.encode(text) == reference.encode(text)
    assert ours.encode(text, add_special_tokens=False) == reference.encode(
        text, add_special_tokens=False
    )


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_smollm2_decodes_like_transformers(smollm2_tokenizers, skip_special_tokens):
    ours, reference = smollm2_tokenizers
    for text in CORPUS:
        ids = reference.encode(text)
        expected = reference.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected


def test_smollm2_splits_every_number_character_like_its_tokenizer_json(smollm2_tokenizers):
    """SmolLM2 isolates each numeric character before byte-level BPE (`Digits(individual_digits)`
    in its tokenizer.json, `\\p{N}` in llama.cpp's "smollm" pre-tokenizer). transformers' GGUF
    converter leaves that step out, which shows on numerals outside 0-9; the reference here is
    its tokenizer with the tokenizer.json pre-tokenizer put back."""
    from tokenizers import pre_tokenizers

    ours, reference = smollm2_tokenizers
    with_digits = copy.deepcopy(reference.backend_tokenizer)
    with_digits.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    for text in ["cost ½ of 12345", "x² + y³", "٣٤٥ and ⅷ", "2024-01-01 3.14"]:
        assert ours.encode(text) == with_digits.encode(text).ids, text


def test_smollm2_special_tokens_and_chat_template_match_transformers(smollm2_tokenizers):
    ours, reference = smollm2_tokenizers
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        reference.bos_token,
        reference.eos_token,
        reference.pad_token,
        reference.unk_token,
    )
    assert ours.eos_token_ids == {reference.eos_token_id}
    assert ours.vocab_size == len(reference)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_load_tokenizer_reads_a_gguf_file(smollm2_tokenizers):
    _, reference = smollm2_tokenizers
    text = "<|im_start|>user\nload me<|im_end|>"
    assert qinfer.load_tokenizer(smollm2_path()).encode(text) == reference.encode(text)


# ------------------------------------------- byte-level BPE with other pre-tokenizers


@pytest.fixture(scope="module")
def small_byte_level_vocab():
    """SmolLM2's first 4000 tokens, their token types, and the merges that stay inside them."""
    meta = read_gguf(smollm2_path()).metadata
    tokens = meta["tokenizer.ggml.tokens"][:4000]
    known = set(tokens)
    merges = [
        merge
        for merge in meta["tokenizer.ggml.merges"]
        if all(part in known for part in merge.split(" ")) and merge.replace(" ", "") in known
    ]
    return tokens, meta["tokenizer.ggml.token_type"][:4000], merges


def add_tiny_model(writer) -> None:
    """The model metadata a GGUF needs besides its tokenizer: one tiny layer."""
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.add_layer_norm_rms_eps(1e-6)


def write_byte_level_gguf(path, vocab, pre, more=lambda writer: None):
    """A gpt2-model tokenizer GGUF; `more` adds metadata."""
    tokens, token_types, merges = vocab

    def describe(writer):
        more(writer)
        add_tiny_model(writer)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(token_types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(pre == "llama-bpe")

    return write_gguf(path, "qwen2", {}, describe)


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-2"])
def test_byte_level_pre_tokenizers_split_like_transformers(tmp_path, small_byte_level_vocab, pre):
    from transformers import AutoTokenizer

    path = write_byte_level_gguf(tmp_path / "tok.gguf", small_byte_level_vocab, pre)
    ours = qinfer.load_tokenizer(path)
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in CORPUS:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text))


def test_end_of_turn_tokens_join_the_eos_ids(tmp_path, small_byte_level_vocab):
    path = write_byte_level_gguf(
        tmp_path / "tok.gguf", small_byte_level_vocab, "qwen2", lambda w: w.add_eot_token_id(7)
    )
    assert tokenizer_from_gguf(path).eos_token_ids == (7,)
    assert qinfer.load_tokenizer(path).eos_token_ids == {2, 7}


def test_unknown_pre_tokenizer_is_named(tmp_path, small_byte_level_vocab):
    path = write_byte_level_gguf(tmp_path / "tok.gguf", small_byte_level_vocab, "made-up")
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.pre 'made-up'"):
        tokenizer_from_gguf(path)


# ----------------------------------------------------------------- SentencePiece BPE

SPM_TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs!",
    "How vexingly quick daft zebras jump; 12 zebras, 345 foxes.",
    "Sphinx of black quartz, judge my vow: the end.",
    "def main():\n    print('hello world')\n",
] * 40


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    """A small SentencePiece BPE model with byte fallback, trained like Llama's (identity
    normalization, whitespace kept and allowed in pieces, a dummy prefix space)."""
    import sentencepiece as spm

    folder = tmp_path_factory.mktemp("spm")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_TRAINING_TEXT),
        model_prefix=str(folder / "spm"),
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_file=str(folder / "spm.model"))


def piece_type(processor, piece: int) -> int:
    """llama.cpp's token type of one SentencePiece piece."""
    if processor.is_unknown(piece):
        return 2
    if processor.is_control(piece):
        return 3
    if processor.is_unused(piece):
        return 5
    return 6 if processor.is_byte(piece) else 1


def write_sentencepiece_gguf(path, processor):
    """The metadata llama.cpp's converter writes for a SentencePiece vocabulary."""
    pieces = range(processor.get_piece_size())
    kinds = [piece_type(processor, i) for i in pieces]

    def describe(writer):
        add_tiny_model(writer)
        writer.add_tokenizer_model("llama")
        writer.add_token_list([processor.id_to_piece(i) for i in pieces])
        writer.add_token_scores([processor.get_score(i) for i in pieces])
        writer.add_token_types(kinds)
        writer.add_bos_token_id(processor.bos_id())
        writer.add_eos_token_id(processor.eos_id())
        writer.add_unk_token_id(processor.unk_id())

    return write_gguf(path, "llama", {}, describe)


SPM_CORPUS = [
    "The lazy fox jumps.",
    "quick zebras judge 2024 boxes",
    "  two leading spaces and a tab\there",
    "line one\nline two\n",
    "unseen letters: ÿ 日本 🤖",
    "indented\n    four spaces",
]


@pytest.mark.parametrize("text", SPM_CORPUS)
def test_sentencepiece_vocabulary_encodes_like_sentencepiece(tmp_path, sentencepiece_model, text):
    ours = qinfer.load_tokenizer(
        write_sentencepiece_gguf(tmp_path / "spm.gguf", sentencepiece_model)
    )
    expected = [sentencepiece_model.bos_id(), *sentencepiece_model.encode(text)]
    assert ours.encode(text) == expected
    assert ours.decode(expected, skip_special_tokens=True) == sentencepiece_model.decode(expected)


def test_unsupported_tokenizer_model_is_named(tmp_path):
    def describe(writer):
        writer.add_tokenizer_model("bert")
        writer.add_token_list(["[PAD]", "a"])

    path = write_gguf(tmp_path / "bert.gguf", "llama", {}, describe)
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.model 'bert'"):
        tokenizer_from_gguf(path)


def test_a_gguf_without_a_tokenizer_is_named(tmp_path):
    path = write_gguf(tmp_path / "bare.gguf", "llama", {})
    with pytest.raises(TokenizerError, match=r"bare\.gguf holds no tokenizer"):
        tokenizer_from_gguf(path)

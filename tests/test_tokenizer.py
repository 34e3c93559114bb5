"""Tokenizer: encode/decode like `transformers`, special tokens, the EOS set, loading errors."""

import pytest
from text_assets import (
    CHATML_SPECIAL,
    LLAMA3_SPECIAL,
    QWEN3_ADDED,
    save_tokenizer_folder,
    train_tokenizer,
)
from tokenizers import processors

import qinfer
from qinfer.core.errors import QinferError, TokenizerError
from qinfer.weights import gguf_tokenizer

TEXTS = [
    "Hello world! How are you today?",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "你好，世界 🦊🌧️ café",
    "<|im_start|>user\nHi<|im_end|>\n<think>\nhm\n</think>",
    "",
]


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    return save_tokenizer_folder(
        tmp_path_factory.mktemp("qwen3"),
        train_tokenizer(CHATML_SPECIAL, QWEN3_ADDED),
        chat_template="{{ messages[0].content }}",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )


@pytest.fixture(scope="module")
def llama3_folder(tmp_path_factory):
    """Llama 3 style: the post-processor puts <|begin_of_text|> in front of every encoding."""
    backend = train_tokenizer(LLAMA3_SPECIAL)
    bos = "<|begin_of_text|>"
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, backend.token_to_id(bos))],
    )
    return save_tokenizer_folder(
        tmp_path_factory.mktemp("llama3"),
        backend,
        bos_token={"__type": "AddedToken", "content": bos, "special": True},  # older spelling
        eos_token="<|eot_id|>",
        generation_config={"eos_token_id": [backend.token_to_id("<|end_of_text|>"), 4]},
        config={"eos_token_id": backend.token_to_id("<|eom_id|>")},
    )


@pytest.fixture(scope="module", params=["qwen3", "llama3"])
def pair(request):
    """(qinfer tokenizer, transformers tokenizer) over the same folder."""
    from transformers import AutoTokenizer

    folder = request.getfixturevalue(f"{request.param}_folder")
    return qinfer.load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(pair, text, add_special_tokens):
    ours, reference = pair
    assert ours.encode(text, add_special_tokens) == reference.encode(
        text, add_special_tokens=add_special_tokens
    )


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(pair, text, skip_special_tokens):
    ours, reference = pair
    ids = reference.encode(text)
    assert ours.decode(ids, skip_special_tokens) == reference.decode(
        ids, skip_special_tokens=skip_special_tokens
    )


def test_special_tokens_and_vocab_size_match_transformers(pair):
    ours, reference = pair
    assert ours.vocab_size == len(reference)
    for name in ("bos_token", "eos_token", "pad_token"):
        assert getattr(ours, name) == getattr(reference, name)
        assert getattr(ours, f"{name}_id") == getattr(reference, f"{name}_id")


def test_llama3_encoding_starts_with_bos(llama3_folder):
    tokenizer = qinfer.load_tokenizer(llama3_folder)
    assert tokenizer.encode("Hi")[0] == tokenizer.bos_token_id
    assert tokenizer.encode("Hi", add_special_tokens=False)[0] != tokenizer.bos_token_id


def test_eos_ids_are_the_union_of_generation_config_config_and_eos_token(llama3_folder):
    tokenizer = qinfer.load_tokenizer(llama3_folder)
    expected = {tokenizer.token_to_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")}
    assert tokenizer.eos_token_ids == frozenset(expected | {4})


def test_eos_ids_without_configs_are_the_eos_token(qwen3_folder):
    tokenizer = qinfer.load_tokenizer(qwen3_folder)
    assert tokenizer.eos_token_ids == {tokenizer.token_to_id("<|im_end|>")}


def test_constructor_adds_eos_token_to_given_ids(qwen3_folder):
    backend = qinfer.load_tokenizer(qwen3_folder).backend
    tokenizer = qinfer.Tokenizer(backend, eos_token="<|im_end|>", eos_token_ids=[0])
    assert tokenizer.eos_token_ids == {0, backend.token_to_id("<|im_end|>")}


def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path):
    folder = save_tokenizer_folder(
        tmp_path, train_tokenizer(CHATML_SPECIAL), chat_template="from config"
    )
    (folder / "chat_template.jinja").write_text("from file", encoding="utf-8")
    assert qinfer.load_tokenizer(folder).chat_template == "from file"


def test_named_chat_templates_use_the_default_one(tmp_path):
    templates = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "chat"}]
    folder = save_tokenizer_folder(
        tmp_path, train_tokenizer(CHATML_SPECIAL), chat_template=templates
    )
    assert qinfer.load_tokenizer(folder).chat_template == "chat"


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        qinfer.load_tokenizer(tmp_path / "nowhere")


def test_folder_without_tokenizer_json_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        qinfer.load_tokenizer(tmp_path)


def test_corrupt_tokenizer_json_is_a_clear_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": "truncated')
    with pytest.raises(TokenizerError, match="cannot read .*tokenizer.json"):
        qinfer.load_tokenizer(tmp_path)


def test_corrupt_tokenizer_config_is_a_clear_error(tmp_path):
    folder = save_tokenizer_folder(tmp_path, train_tokenizer(CHATML_SPECIAL))
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        qinfer.load_tokenizer(folder)


def test_tokenizer_errors_are_qinfer_errors():
    assert issubclass(TokenizerError, QinferError)


def test_encode_rejects_non_text(qwen3_folder):
    with pytest.raises(TokenizerError, match="expects a string"):
        qinfer.load_tokenizer(qwen3_folder).encode(["not", "text"])


def test_gguf_path_is_read_by_the_gguf_tokenizer_builder(tmp_path, monkeypatch, qwen3_folder):
    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF")
    backend = qinfer.load_tokenizer(qwen3_folder).backend
    read = gguf_tokenizer.GGUFTokenizer(
        backend,
        chat_template="{{ messages }}",
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        eos_token_ids=(7,),
    )

    def tokenizer_from_gguf(path):
        assert path == gguf_file
        return read

    monkeypatch.setattr(gguf_tokenizer, "tokenizer_from_gguf", tokenizer_from_gguf)
    tokenizer = qinfer.load_tokenizer(gguf_file)
    assert tokenizer.backend is backend and tokenizer.chat_template == "{{ messages }}"
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tokenizer.eos_token_ids == {7, backend.token_to_id("<|im_end|>")}


def test_generation_config_eos_may_be_a_single_int(tmp_path):
    folder = save_tokenizer_folder(
        tmp_path, train_tokenizer(CHATML_SPECIAL), generation_config={"eos_token_id": 1}
    )
    assert qinfer.load_tokenizer(folder).eos_token_ids == {1}


def test_tokenizer_json_alone_is_enough(tmp_path):
    train_tokenizer(CHATML_SPECIAL).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text('{"eos_token_id": 2}')
    tokenizer = qinfer.load_tokenizer(tmp_path)
    assert tokenizer.eos_token_ids == {2} and tokenizer.eos_token is None
    assert not tokenizer.has_chat_template
    assert tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"

"""Tokenizer: text <-> token ids, special tokens, the end-of-sequence set and the chat template.

A Hugging Face checkpoint folder describes its tokenizer in up to five files:

- `tokenizer.json`: the whole pipeline (normalizer, pre-tokenizer, BPE/Unigram model,
  decoder, post-processor that adds BOS), read by the `tokenizers` library;
- `tokenizer_config.json`: the named special tokens (`bos_token`, `eos_token`,
  `pad_token`, as strings or `{"content": ...}` dicts) and, in older checkpoints, the
  `chat_template` (a string, or a list of named templates);
- `chat_template.jinja`: the chat template, where `transformers` >= 4.50 saves it;
- `generation_config.json` and `config.json`: `eos_token_id` (an int or a list).

Generation stops on any id in `Tokenizer.eos_token_ids`, the union of all of these:
Llama 3 Instruct ends turns with `<|eot_id|>` but names `<|end_of_text|>` as EOS token,
and only generation_config.json lists both.

A `.gguf` file carries all of this in its metadata; `qinfer.weights.gguf_tokenizer` reads it
and `load_tokenizer` wraps what it read in the same Tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from qinfer.core.checkpoint import read_json_object
from qinfer.core.errors import TokenizerError
from qinfer.text.chat_template import render_chat_template

# The special tokens transformers passes to chat templates by name.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what a chat model needs around it.

    backend: the `tokenizers.Tokenizer` that does the work (from tokenizer.json or GGUF).
    chat_template: Jinja source of the chat template, or None.
    bos_token / eos_token / pad_token: the named special tokens, as text.
    eos_token_ids: ids that end generation; the id of `eos_token` is always added.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        eos_ids = {int(i) for i in eos_token_ids}
        if eos_token is not None and backend.token_to_id(eos_token) is not None:
            eos_ids.add(backend.token_to_id(eos_token))
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, eos_token_ids={sorted(self.eos_token_ids)}, "
            f"chat_template={'yes' if self.has_chat_template else 'no'})"
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token)

    @property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens that are set, as chat templates see them."""
        named = {name: getattr(self, name) for name in NAMED_SPECIAL_TOKENS}
        return {name: token for name, token in named.items() if token is not None}

    def token_to_id(self, token: str | None) -> int | None:
        """Id of one token's text (`"<|im_end|>"` -> 151645), None if not in the vocabulary."""
        return None if token is None else self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of one id (byte-level BPE spells a space as "Ġ")."""
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens lets the post-processor add BOS/EOS.

        Text already holding special tokens (a rendered chat template) is encoded with
        add_special_tokens=False, as `transformers` does, so BOS is not doubled.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a string, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`. A byte-level token that ends mid-character decodes as U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`, equal to `transformers`' apply_chat_template(tokenize=False).

        kwargs reach the template as variables (`enable_thinking=False`, `documents=[...]`).
        Encode the result with add_special_tokens=False.
        """
        if not self.chat_template:
            raise TokenizerError(
                "this tokenizer has no chat template; pass a plain prompt instead of messages"
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens=self.special_tokens,
            **kwargs,
        )


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load the tokenizer of a checkpoint: a Hugging Face folder or a `.gguf` file."""
    path = Path(path)
    if path.suffix == ".gguf" and path.is_file():
        from qinfer.weights.gguf_tokenizer import tokenizer_from_gguf

        gguf = tokenizer_from_gguf(path)
        return Tokenizer(
            gguf.backend,
            chat_template=gguf.chat_template,
            bos_token=gguf.bos_token,
            eos_token=gguf.eos_token,
            pad_token=gguf.pad_token,
            unk_token=gguf.unk_token,
            eos_token_ids=gguf.eos_token_ids,
        )
    if not path.exists():
        raise TokenizerError(f"tokenizer path {path} does not exist")
    if not path.is_dir():
        raise TokenizerError(f"tokenizer path {path} is neither a folder nor a .gguf file")
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise TokenizerError(
            f"{path} has no tokenizer.json (only fast tokenizers are supported; "
            "convert a sentencepiece tokenizer.model with transformers first)"
        )
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as error:  # the tokenizers library raises a bare Exception
        raise TokenizerError(f"cannot read {tokenizer_file}: {error}") from None

    config = _read_json(path / "tokenizer_config.json")
    special = {name: _token_text(config.get(name)) for name in NAMED_SPECIAL_TOKENS}
    eos_token_ids = [
        *_ids(_read_json(path / "generation_config.json").get("eos_token_id")),
        *_ids(_read_json(path / "config.json").get("eos_token_id")),
    ]
    return Tokenizer(
        backend,
        chat_template=_read_chat_template(path, config),
        eos_token_ids=eos_token_ids,
        **special,
    )


def _read_json(file: Path) -> dict[str, Any]:
    """A JSON object from `file`; {} when the file does not exist."""
    return read_json_object(file, TokenizerError) if file.is_file() else {}


def _token_text(entry: Any) -> str | None:
    """A special token as written in tokenizer_config.json: "<s>" or {"content": "<s>", ...}."""
    if isinstance(entry, Mapping):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


def _ids(value: Any) -> list[int]:
    """`eos_token_id` as configs write it: absent, an int or a list of ints."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int)]


def _read_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja first, then tokenizer_config.json."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None

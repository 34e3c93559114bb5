"""The tokenizer a GGUF file describes in its `tokenizer.*` metadata: a `tokenizers` pipeline
and the settings around it, which `qinfer.text.tokenizer.load_tokenizer` wraps in its Tokenizer.

A GGUF carries no `tokenizer.json`; llama.cpp stores the pieces instead:

- `tokenizer.ggml.model`: "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE);
- `tokenizer.ggml.tokens` (the vocabulary, id order), `token_type` (1 normal, 2 unknown,
  3 control, 4 user-defined, 5 unused, 6 byte), `merges` (gpt2) or `scores` (llama);
- `tokenizer.ggml.pre`: which regex splits text into words before byte-level BPE;
- `tokenizer.ggml.{bos,eos,eot,eom,padding,unknown}_token_id`, `add_bos_token`;
- `tokenizer.chat_template`.

We rebuild the equivalent `tokenizers.Tokenizer` pipeline: control tokens become special
added tokens (matched whole, skipped by `decode(skip_special_tokens=True)`), user-defined
ones plain added tokens, and BOS is prepended by the post-processor when `add_bos_token`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers import Tokenizer as Backend

from qinfer.core.errors import QinferError, TokenizerError
from qinfer.weights.gguf_file import read_gguf

CONTROL, USER_DEFINED = 3, 4

# Word-splitting regexes of llama.cpp's pre-tokenizer types (llama-vocab.cpp), by family.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regexes applied one after the other (each splits the pieces
# the previous one left). SmolLM first isolates every digit, then splits like GPT-2.
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (GPT2_SPLIT,),
    "gpt-2": (GPT2_SPLIT,),
    "smollm": (r"\p{N}", GPT2_SPLIT),
    "llama-bpe": (LLAMA3_SPLIT,),
    "llama3": (LLAMA3_SPLIT,),
    "llama-v3": (LLAMA3_SPLIT,),
    "qwen2": (QWEN2_SPLIT,),
    "deepseek-r1-qwen": (QWEN2_SPLIT,),
}
# Pre-tokenizer types whose vocabulary is used whole when a word is one token, before any
# merge (llama.cpp's `ignore_merges`, tokenizer.json's `"ignore_merges": true`).
IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3"})


@dataclass(frozen=True)
class GGUFTokenizer:
    """What a `.gguf` file says about its tokenizer, as the arguments of
    `qinfer.text.tokenizer.Tokenizer`.

    eos_token_ids: the end-of-turn ids (`eot`, `eom`); the Tokenizer adds eos_token's id.
    """

    backend: Backend
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    eos_token_ids: tuple[int, ...]


def tokenizer_from_gguf(path: str | Path) -> GGUFTokenizer:
    """The tokenizer pipeline, special tokens, EOS ids and chat template of a `.gguf` file."""
    path = Path(path)
    try:
        meta = read_gguf(path).metadata
    except QinferError as e:
        raise TokenizerError(str(e)) from None
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError(f"{path} holds no tokenizer (tokenizer.ggml.tokens is missing)")
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        backend = _byte_level_bpe(meta, path)
        add_bos_default = False
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta)
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary by default
    else:
        raise TokenizerError(
            f"{path}: tokenizer.ggml.model {kind!r} is not supported; supported: gpt2, llama"
        )
    _add_special_tokens(backend, tokens, meta.get("tokenizer.ggml.token_type") or ())

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if token_id is None or not 0 <= token_id < len(tokens) else tokens[token_id]

    bos = token("bos")
    if meta.get("tokenizer.ggml.add_bos_token", add_bos_default) and bos is not None:
        bos_id = meta["tokenizer.ggml.bos_token_id"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    end_of_generation = [meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eot", "eom")]
    return GGUFTokenizer(
        backend,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=bos,
        eos_token=token("eos"),
        pad_token=token("padding"),
        unk_token=token("unknown"),
        eos_token_ids=tuple(i for i in end_of_generation if i is not None),
    )


def _byte_level_bpe(meta: dict[str, Any], path: Path) -> Backend:
    """GPT-2 style BPE over bytes spelled as printable characters ("Ġ" is a space)."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise TokenizerError(
            f"{path}: tokenizer.ggml.pre {pre!r} is not supported; "
            f"supported: {', '.join(PRE_TOKENIZER_SPLITS)}"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges") or ()]
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Backend(models.BPE(vocab, merges, ignore_merges=pre in IGNORE_MERGES))
    splits = [
        pre_tokenizers.Split(Regex(regex), behavior="isolated")
        for regex in PRE_TOKENIZER_SPLITS[pre]
    ]
    # After the splits, ByteLevel only respells each piece's bytes (no regex of its own).
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: dict[str, Any]) -> Backend:
    """SentencePiece BPE (Llama 2, Mistral): "▁" marks a space, unknown bytes fall back to
    `<0xNN>` tokens, and the merge order follows the token scores."""
    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    unknown_id = meta.get("tokenizer.ggml.unknown_token_id")
    vocab = {token: index for index, token in enumerate(tokens)}
    model = models.BPE(
        vocab,
        _merges_by_score(tokens, scores, types),
        unk_token=None if unknown_id is None else tokens[unknown_id],
        byte_fallback=True,
        fuse_unk=True,
    )
    backend = Backend(model)
    # Spaces become "▁" and, as llama.cpp does, each run of text (the start, and after every
    # special token) gets one "▁" in front. (Metaspace would skip it before a leading space.)
    space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # the space the prefix added
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_by_score(
    tokens: list[str], scores: list[float], types: list[int]
) -> list[tuple[str, str]]:
    """BPE merges that rebuild SentencePiece's choice: the pair whose union scores highest.

    Every normal token that splits into two normal tokens gives a merge for each such
    split, ranked by the token's score (ties: shorter left part first).
    """
    normal = {token for token, kind in zip(tokens, types, strict=True) if kind == 1}
    ranked = []
    for token, score in zip(tokens, scores, strict=True):
        if token not in normal:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-score, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _add_special_tokens(backend: Backend, tokens: list[str], types: list[int]) -> None:
    """Control tokens as special added tokens, user-defined ones as plain added tokens.

    Both are matched whole in the text before the pre-tokenizer runs (as llama.cpp does),
    and keep their ids because they are already in the vocabulary.
    """
    backend.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, types, strict=False)
            if kind == CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in zip(tokens, types, strict=False)
            if kind == USER_DEFINED
        ]
    )

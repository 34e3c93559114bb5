"""Prompts: what a caller may give as a prompt, and the token ids it becomes.

A prompt is one of
    text                 "The capital of France is"   (encoded as-is, or wrapped as one
                                                        user message when `chat=True`)
    token ids            [1, 504, 3458]               (used as-is)
    chat messages        [{"role": "user", "content": "Hi"}]   (rendered with the
                                                        tokenizer's chat template)

`generate`, `LLM.generate` and the engine take either one prompt or a list of them;
`is_batch` tells the two apart. Generation stops on `eos_token_ids`: the union of the
ids the model config and the tokenizer declare.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from qinfer.config import ModelConfig
from qinfer.errors import QinferError
from qinfer.text.tokenizer import Tokenizer

Messages = Sequence[Mapping[str, object]]
Prompt = str | Sequence[int] | Messages


def is_batch(prompt: object) -> bool:
    """True for a list of prompts, False for one prompt (text, token ids or messages).

    A list is one prompt when its first item is a token id or a message; an empty list
    counts as one (empty) prompt, which `encode_prompt` refuses.
    """
    if isinstance(prompt, str) or not isinstance(prompt, Sequence) or not prompt:
        return False
    return not isinstance(prompt[0], (int, Mapping))


def is_token_ids(prompt: object) -> bool:
    """True for a non-empty list of token ids (ints, not bools)."""
    return (
        not isinstance(prompt, str)
        and isinstance(prompt, Sequence)
        and bool(prompt)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )


def encode_prompt(
    tokenizer: Tokenizer | None,
    prompt: Prompt,
    chat: bool = False,
    vocab_size: int | None = None,
    **template_kwargs,
) -> list[int]:
    """Token ids of one prompt (see the module docstring), or a QinferError saying why not.

    tokenizer: needed for text and messages (None: only token ids are accepted).
    vocab_size: when given, token ids must lie in [0, vocab_size).
    template_kwargs: variables for the chat template (Qwen3's `enable_thinking`).
    """
    if not isinstance(prompt, (str, Sequence)):
        raise QinferError(
            f"prompt must be text, token ids or chat messages, got {type(prompt).__name__}"
        )
    if not prompt:
        raise QinferError("prompt is empty: give some text, token ids or messages")
    ids = _token_ids(tokenizer, prompt, chat, template_kwargs)
    # The model looks ids up in its embedding unchecked: refuse any it lacks here.
    bad = next((t for t in ids if vocab_size is not None and not 0 <= t < vocab_size), None)
    if bad is not None:
        raise QinferError(f"prompt token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    return ids


def _token_ids(
    tokenizer: Tokenizer | None, prompt: Prompt, chat: bool, template_kwargs: dict
) -> list[int]:
    if is_token_ids(prompt):
        return list(prompt)
    if tokenizer is None:
        raise QinferError("there is no tokenizer: give token ids, or pass tokenizer=")
    if isinstance(prompt, str):
        if not chat:
            ids = tokenizer.encode(prompt)
            if not ids:
                raise QinferError("prompt encodes to no tokens")
            return ids
        prompt = [{"role": "user", "content": prompt}]
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping) or "role" not in message:
            raise QinferError(f"messages[{i}] must be a dict with a 'role' and a 'content'")
    if not tokenizer.has_chat_template:
        raise QinferError("this tokenizer has no chat template: give a plain string prompt")
    # add_generation_prompt defaults to True: the prompt ends where the reply begins.
    text = tokenizer.apply_chat_template(
        list(prompt), **{"add_generation_prompt": True, **template_kwargs}
    )
    # The template writes the special tokens (BOS included) itself, as transformers does.
    return tokenizer.encode(text, add_special_tokens=False)


def eos_token_ids(config: ModelConfig, tokenizer: Tokenizer | None) -> frozenset[int]:
    """The union of the end-of-sequence ids the model config and the tokenizer (if any)
    declare."""
    declared = frozenset(tokenizer.eos_token_ids) if tokenizer is not None else frozenset()
    return frozenset(config.eos_token_id) | declared

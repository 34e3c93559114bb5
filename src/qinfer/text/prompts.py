"""Prompts: what a caller may give as a prompt, and the token ids it becomes.

A prompt is one of
    text                 "The capital of France is"   (encoded as-is, or wrapped as one
                                                        user message when `chat=True`)
    token ids            [1, 504, 3458]               (used as-is)
    chat messages        [{"role": "user", "content": "Hi"}]   (rendered with the
                                                        tokenizer's chat template)
    images               content parts {"type": "image", "image": path | bytes | PIL image}
                         in a message's content list, or an `ImagePrompt(token_ids, images)`
                         whose ids already hold each image's run of image tokens

A message's image part becomes Qwen-VL's placeholder `IMAGE_PLACEHOLDER` where it stands:
written by the chat template when it renders image parts (its source names <|image_pad|>),
else put in the message's text by `encode_prompt_parts`; the engine, which knows each
image's size, expands the placeholder's <|image_pad|> to the image's run of tokens.

`generate`, `LLM.generate` and the engine take either one prompt or a list of them;
`is_batch` tells the two apart. Generation stops on `eos_token_ids`: the union of the
ids the model config and the tokenizer declare.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from PIL import Image

from qinfer.core.errors import QinferError
from qinfer.core.model_config import ModelConfig
from qinfer.text.tokenizer import Tokenizer
from qinfer.vision.image import ImageSource
from qinfer.vision.language_model import ImagePrompt

Messages = Sequence[Mapping[str, object]]

#: Qwen-VL's image token, and the run an image part stands for in a rendered prompt (one
#: <|image_pad|>, which the engine expands to the image's tokens).
IMAGE_PAD = "<|image_pad|>"
IMAGE_PLACEHOLDER = f"<|vision_start|>{IMAGE_PAD}<|vision_end|>"


@dataclass(frozen=True)
class PromptParts:
    """A prompt's token ids and its images, in the order their tokens appear.

    placeholders: True when each image is still one image token (a rendered
    `IMAGE_PLACEHOLDER`) to expand to its run; False when the ids hold each run whole (an
    `ImagePrompt`), or there is no image."""

    token_ids: list[int]
    images: tuple[ImageSource | Image.Image, ...] = ()
    placeholders: bool = False


#: A `PromptParts` is a prompt already encoded (`encode_prompt_parts`).
Prompt = str | Sequence[int] | Messages | ImagePrompt | PromptParts


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
    """Token ids of one prompt without images (see the module docstring), or a QinferError
    saying why not.

    tokenizer: needed for text and messages (None: only token ids are accepted).
    vocab_size: when given, token ids must lie in [0, vocab_size).
    template_kwargs: variables for the chat template (Qwen3's `enable_thinking`).
    """
    parts = encode_prompt_parts(tokenizer, prompt, chat, vocab_size, **template_kwargs)
    if parts.images:
        raise QinferError(
            f"the prompt holds {len(parts.images)} image(s): this entry point takes text only"
        )
    return parts.token_ids


def encode_prompt_parts(
    tokenizer: Tokenizer | None,
    prompt: Prompt,
    chat: bool = False,
    vocab_size: int | None = None,
    **template_kwargs,
) -> PromptParts:
    """Token ids and images of one prompt (`encode_prompt`'s arguments), images allowed.

    A `PromptParts` is taken as encoded (its ids still checked): a caller that renders the
    template itself, with tools and template variables (the server), hands it on so."""
    if isinstance(prompt, PromptParts):
        parts = prompt
    elif isinstance(prompt, ImagePrompt):
        if not is_token_ids(prompt.token_ids):
            raise QinferError("ImagePrompt.token_ids must be a non-empty list of token ids")
        parts = PromptParts(list(prompt.token_ids), tuple(prompt.images))
    elif not isinstance(prompt, (str, Sequence)):
        raise QinferError(
            "prompt must be text, token ids, chat messages or an ImagePrompt, got "
            f"{type(prompt).__name__}"
        )
    elif not prompt:
        raise QinferError("prompt is empty: give some text, token ids or messages")
    else:
        parts = _prompt_parts(tokenizer, prompt, chat, template_kwargs)
    # The model looks ids up in its embedding unchecked: refuse any it lacks here.
    ids = parts.token_ids
    bad = next((t for t in ids if vocab_size is not None and not 0 <= t < vocab_size), None)
    if bad is not None:
        raise QinferError(f"prompt token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    return parts


def _prompt_parts(
    tokenizer: Tokenizer | None, prompt: Prompt, chat: bool, template_kwargs: dict
) -> PromptParts:
    if is_token_ids(prompt):
        return PromptParts(list(prompt))
    if tokenizer is None:
        raise QinferError("there is no tokenizer: give token ids, or pass tokenizer=")
    if isinstance(prompt, str):
        if not chat:
            ids = tokenizer.encode(prompt)
            if not ids:
                raise QinferError("prompt encodes to no tokens")
            return PromptParts(ids)
        prompt = [{"role": "user", "content": prompt}]
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping) or "role" not in message:
            raise QinferError(f"messages[{i}] must be a dict with a 'role' and a 'content'")
    if not tokenizer.has_chat_template:
        raise QinferError("this tokenizer has no chat template: give a plain string prompt")
    messages, images = list(prompt), _message_images(prompt)
    if images and IMAGE_PAD not in tokenizer.chat_template:
        messages = [_placeholders_in_text(message) for message in messages]
    # add_generation_prompt defaults to True: the prompt ends where the reply begins.
    text = tokenizer.apply_chat_template(
        messages, **{"add_generation_prompt": True, **template_kwargs}
    )
    # The template writes the special tokens (BOS included) itself, as transformers does.
    return PromptParts(tokenizer.encode(text, add_special_tokens=False), images, bool(images))


def _image_parts(message: Mapping[str, object]) -> list[Mapping[str, object]]:
    """The image content parts of a message (none where its content is text)."""
    content = message.get("content")
    if isinstance(content, str) or not isinstance(content, Sequence):
        return []
    return [p for p in content if isinstance(p, Mapping) and p.get("type") == "image"]


def _message_images(messages: Messages) -> tuple[ImageSource | Image.Image, ...]:
    """Every image part's image, message after message, in content order."""
    images = []
    for i, message in enumerate(messages):
        for part in _image_parts(message):
            if "image" not in part:
                raise QinferError(
                    f"messages[{i}] has an image part without an 'image' (a path, bytes or "
                    "a PIL image)"
                )
            images.append(part["image"])
    return tuple(images)


def _placeholders_in_text(message: Mapping[str, object]) -> Mapping[str, object]:
    """A message whose content parts hold images, as one text for a template that renders
    text only: its text parts joined, each image part replaced by `IMAGE_PLACEHOLDER`."""
    images = _image_parts(message)
    if not images:
        return message
    text = "".join(
        IMAGE_PLACEHOLDER
        if part in images
        else str(part.get("text", "") if isinstance(part, Mapping) else part)
        for part in message["content"]
    )
    return {**message, "content": text}


def eos_token_ids(config: ModelConfig, tokenizer: Tokenizer | None) -> frozenset[int]:
    """The union of the end-of-sequence ids the model config and the tokenizer (if any)
    declare."""
    declared = frozenset(tokenizer.eos_token_ids) if tokenizer is not None else frozenset()
    return frozenset(config.eos_token_id) | declared

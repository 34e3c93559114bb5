"""A random Qwen3 checkpoint that answers a chat as a thinking model would, for server tests.

The checkpoint is random except for one planted path, so that a chat can be checked for
its reasoning without a trained model: after "\\n" (where every chat prompt ends) the
model always writes `<think>The answer</think>\\n\\nHello<|im_end|>` (a Qwen3 thinking
reply), and after the "\\n\\n" that closes Qwen3's empty think block
(`enable_thinking=False`) it writes `Hello<|im_end|>`. Anywhere else it writes random
text and, in practice, never stops before max_tokens.
"""

from __future__ import annotations

from pathlib import Path

import tokenizers
import torch
from checkpoints import build_checkpoint
from text_assets import CHATML_SPECIAL, QWEN3_ADDED, save_qwen3_tokenizer, train_tokenizer

#: What the planted model thinks, then answers, greedily after a chat prompt.
PLANTED_REASONING, PLANTED_ANSWER = "The answer", "Hello"


def plant_path(model, path: list[int]) -> None:
    """Make `model` (a transformers Qwen3 with untied head) follow `path` token by token.

    Hidden dimension k carries "the current token is path[k]": only that token's
    embedding has it, and only the head row of path[k + 1] reads it. The embeddings are
    scaled up so the random layers barely move the residual stream. One more dimension,
    present in every embedding, pushes the path's tokens (EOS last among them) down
    everywhere else, so random text does not stumble into the path or stop.
    """
    steps, bias_dim = len(path) - 1, len(path) - 1
    with torch.no_grad():
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.mul_(20)
        embed[:, : steps + 1] = 0
        embed[:, bias_dim] = 5.0
        for token in path:
            head[token] = 0
            head[token, bias_dim] = -1.0
        for k, (current, following) in enumerate(zip(path, path[1:], strict=False)):
            embed[current, k] = 10.0
            head[following, k] = 4.0


def build_planted_qwen3(folder: Path, **overrides) -> Path:
    """Save the planted Qwen3 (module docstring) with a Qwen3 tokenizer and chat template
    to `folder`; `overrides` shape its config (max_position_embeddings for long prompts)."""
    backend = train_tokenizer(CHATML_SPECIAL, QWEN3_ADDED)
    # "\n\n" as one token tells the end of Qwen3's empty think block from a lone "\n".
    backend.add_tokens([tokenizers.AddedToken("\n\n", special=False, normalized=False)])
    im_end = backend.token_to_id("<|im_end|>")
    save_qwen3_tokenizer(folder, backend)
    model = build_checkpoint(
        folder,
        "qwen3",
        vocab_size=backend.get_vocab_size(),
        tie_word_embeddings=False,
        eos_token_id=im_end,
        **overrides,
    )

    def ids(text: str) -> list[int]:
        return backend.encode(text, add_special_tokens=False).ids

    think = ids(f"<think>{PLANTED_REASONING}</think>")
    path = [*ids("\n"), *think, *ids(f"\n\n{PLANTED_ANSWER}"), im_end]
    plant_path(model, path)
    model.save_pretrained(folder)
    return folder

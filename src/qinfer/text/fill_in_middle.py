"""Fill in the middle (FIM): a completion that joins a prompt to the text after it.

Code models trained for it read the text before and after a gap between their FIM
tokens, prefix first ("PSM" order), and write the middle:

    <|fim_prefix|>def add(a, b):<|fim_suffix|>    return c<|fim_middle|>

Qwen2.5-Coder and Qwen3's tokenizers spell the tokens `<|fim_prefix|>`, `<|fim_suffix|>`,
`<|fim_middle|>`; StarCoder's (and models built on its tokenizer) `<fim_prefix>`,
`<fim_suffix>`, `<fim_middle>`. `fim_tokens` finds which set a tokenizer's vocabulary
holds, whole, or None: then the model cannot be asked to fill a gap (the embedded
SmolLM2's vocabulary has none of them).
"""

from __future__ import annotations

from dataclasses import dataclass

from qinfer.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class FimTokens:
    """The three tokens that frame a fill-in-the-middle prompt."""

    prefix: str
    suffix: str
    middle: str

    def prompt(self, before: str, after: str) -> str:
        """The PSM prompt whose completion is the text between `before` and `after`."""
        return f"{self.prefix}{before}{self.suffix}{after}{self.middle}"


#: The FIM token sets known, most common first.
KNOWN_FIM_TOKENS = (
    FimTokens("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    FimTokens("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
)


def fim_tokens(tokenizer: Tokenizer) -> FimTokens | None:
    """The FIM tokens whose three entries are all in `tokenizer`'s vocabulary, or None."""
    for tokens in KNOWN_FIM_TOKENS:
        if all(
            tokenizer.token_to_id(t) is not None
            for t in (tokens.prefix, tokens.suffix, tokens.middle)
        ):
            return tokens
    return None

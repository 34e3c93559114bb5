"""The settings of speculative decoding, checked once when the engine starts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qinfer.core.errors import QinferError

if TYPE_CHECKING:
    from qinfer.model.transformer import Transformer

METHODS = ("ngram", "draft", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine proposes tokens to verify.

    method: "ngram" (prompt lookup: no extra model), "draft" (a draft model) or "mtp"
        (the checkpoint's own multi-token-prediction head: Qwen3.5 / Qwen3.6).
    num_speculative_tokens: the most tokens proposed per sequence and step (k); the
        engine lowers it per sequence while its proposals are rejected (adaptive k).
    model: the draft model ("draft" only): a checkpoint path, or a loaded `Transformer`
        with the target's vocabulary, on the target's device. The target's own file loaded
        again (a GGUF keeps its 4-bit blocks) drafts for an fp32 or bf16 target.
    quantize, dtype: how the draft checkpoint is loaded (as `qinfer.load_model`).
    prompt_lookup_min, prompt_lookup_max: the n-gram sizes "ngram" matches, the longest
        first.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | Path | Transformer | None = None
    quantize: str | None = None
    dtype: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise QinferError(
                f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise QinferError(f"speculative {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise QinferError(
                f"speculative prompt_lookup_min ({self.prompt_lookup_min}) is above "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if (self.method == "draft") != (self.model is not None):
            raise QinferError(
                "speculative model is needed by method 'draft' and by no other"
                if self.model is None
                else f"speculative model is for method 'draft', not {self.method!r}"
            )

    @classmethod
    def create(
        cls, value: SpeculativeConfig | Mapping[str, Any] | None
    ) -> SpeculativeConfig | None:
        """A config from a mapping (`LLM(..., speculative={...})`), naming unknown keys."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise QinferError(
                f"speculative must be a mapping of settings, got {type(value).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise QinferError(
                f"unknown speculative setting {unknown[0]!r}; known: {', '.join(sorted(known))}"
            )
        return cls(**value)

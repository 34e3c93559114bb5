"""How a conversation samples when nobody chose: `qinfer chat`, and the fields a
`POST /v1/chat/completions` request leaves unset.

Greedy decoding is the rule for `qinfer generate` and `/v1/completions` (transformers'
default: exact and reproducible), but a small model decoding greedily loops ("A lone soul,
a lone soul, ..."), and a chat has no one to stop it. A conversation therefore samples,
with a mild repetition penalty and a length cap, unless the checkpoint's
generation_config.json sets its own sampling fields (Qwen3 and Llama 3 do), which win; a
value given explicitly (a flag, a request field) wins over both. Temperature 0 stays
greedy decoding as everywhere else: no repetition penalty is added to it.

The figures are tested on the embedded SmolLM2-135M: asked for a story or greeted, no 8-gram
comes back more than 3 times in 256 tokens over 5 seeds (tests/test_newcomer_cli.py). Over 20
seeds of each (2026-12-07), a penalty of 1.1 let one greeting in 20 loop (an 8-gram 17
times), 1.15 and 1.2 none: 1.15, the milder.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: A conversation's sampling when neither the checkpoint nor the caller sets a field.
#: repetition_penalty (HF semantics) lowers the logit of every token already in the
#: conversation; presence/frequency penalties, counted over the reply only, let a
#: 135M model loop over a story's first sentences before they bite.
CHAT_DEFAULTS: Mapping[str, Any] = {
    "temperature": 0.7,
    "top_p": 0.9,
    "repetition_penalty": 1.15,
    "max_tokens": 1024,
}

#: The fields of CHAT_DEFAULTS that shape sampling only: a greedy conversation
#: (temperature 0, asked for or set by the checkpoint) is the model's argmax, exactly as
#: `generate`, `/v1/completions` and transformers decode, with no penalty added.
SAMPLING_ONLY = ("top_p", "repetition_penalty")

#: `qinfer generate`'s cap on new tokens when --max-tokens is not given.
GENERATE_MAX_TOKENS = 256


def chat_sampling_params(source: str | Path | Mapping[str, Any] | None, **overrides: Any):
    """The SamplingParams of a conversation: CHAT_DEFAULTS, then the sampling fields of
    `source`'s generation_config.json (a checkpoint folder, the file, its dict, or None),
    then the `overrides` that are not None (flags, request fields). A greedy choice
    (temperature 0) leaves out the defaults of SAMPLING_ONLY."""
    from qinfer.request.sampling import SamplingParams, checkpoint_sampling  # imports torch

    given = {name: value for name, value in overrides.items() if value is not None}
    chosen = {**checkpoint_sampling(source), **given}
    defaults = dict(CHAT_DEFAULTS)
    if chosen.get("temperature", defaults["temperature"]) == 0:
        for name in SAMPLING_ONLY:
            del defaults[name]
    return SamplingParams(**{**defaults, **chosen})

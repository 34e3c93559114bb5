"""Text in, text out, for a loaded model: a thin front-end of the engine.

    generate(model, tokenizer, prompt, params)         -> GenerationResult
    generate(model, tokenizer, [p1, p2, ...], params)  -> [GenerationResult, ...]
    stream = stream_generate(model, tokenizer, prompt, params)
    for delta in stream: ...                           # text deltas; then stream.result

A prompt is a string (used as-is, or wrapped as one user message with `chat=True`), a
list of token ids (used as-is), or a list of chat messages (always rendered with the
tokenizer's chat template; template options such as Qwen3's `enable_thinking` pass
through as keyword arguments); see `qinfer.text.prompts`.

Each call runs its prompts through an `Engine` of its own over the model, with a KV pool
sized for exactly these prompts and their max_tokens: the same scheduler, paged attention,
sampling and stop rules as `LLM` and the server, so a prompt gets the same tokens from
every entry point (the `LLM` keeps one engine and its prefix cache across calls).

A row ends with finish_reason
    "eos"     on one of the model's end-of-sequence ids (config, generation config and
              tokenizer together) unless `ignore_eos`,
    "stop"    on one of `stop_token_ids`, or when the text reaches a stop string (the stop
              string and whatever follows it are cut from the text),
    "length"  after `max_tokens` tokens, or when the model's context is full: max_tokens
              is cut to the room the context leaves after the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

from qinfer.core.errors import QinferError
from qinfer.engine.config import EngineConfig
from qinfer.engine.engine import Engine
from qinfer.engine.outputs import GenerationResult, Timings
from qinfer.engine.request import Request
from qinfer.engine.run import TextStream, run_to_end
from qinfer.model.transformer import Transformer
from qinfer.request.sampling import SamplingParams
from qinfer.text.prompts import Prompt, encode_prompt, is_batch
from qinfer.text.tokenizer import Tokenizer

__all__ = [
    "GenerationResult",
    "TextStream",
    "Timings",
    "generate",
    "generate_ids",
    "stream_generate",
]


def generate(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt: Prompt | Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    chat: bool = False,
    **template_kwargs,
) -> GenerationResult | list[GenerationResult]:
    """Generate for one prompt (-> GenerationResult) or a batch (a list of prompts, each
    text, token ids or a list of messages -> a list of GenerationResult, in order).

    params: one SamplingParams for every prompt, or one per prompt (default:
        SamplingParams()).
    """
    batch = is_batch(prompt)
    prompts = list(prompt) if batch else [prompt]
    engine, requests = _requests(model, tokenizer, prompts, params, chat, template_kwargs)
    results = run_to_end(engine, requests)
    return results if batch else results[0]


def stream_generate(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt: Prompt,
    params: SamplingParams | None = None,
    *,
    chat: bool = False,
    **template_kwargs,
) -> TextStream:
    """Like `generate` for one prompt, as a stream of text deltas. The prompt is checked
    here, before the first delta is asked for; the model runs as the stream is read."""
    if is_batch(prompt):
        raise QinferError("stream_generate takes one prompt; use generate for a batch")
    engine, (request,) = _requests(model, tokenizer, [prompt], params, chat, template_kwargs)
    return TextStream(engine, request)


def generate_ids(
    model: Transformer,
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    eos_ids: frozenset[int] = frozenset(),
) -> list[GenerationResult]:
    """Token ids in, token ids out (no tokenizer: results carry empty text). For benchmarks
    and callers that tokenize themselves; rows end on `eos_ids` unless ignore_eos."""
    if not prompt_ids or any(len(ids) == 0 for ids in prompt_ids):
        raise QinferError("prompt_ids must hold at least one non-empty row of token ids")
    encoded = [list(ids) for ids in prompt_ids]
    engine, requests = _engine_requests(model, None, encoded, params, eos_ids)
    return run_to_end(engine, requests)


def _requests(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: list[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None,
    chat: bool,
    template_kwargs: dict,
) -> tuple[Engine, list[Request]]:
    vocab = model.config.vocab_size
    encoded = [encode_prompt(tokenizer, p, chat, vocab, **template_kwargs) for p in prompts]
    return _engine_requests(model, tokenizer, encoded, params)


def _engine_requests(
    model: Transformer,
    tokenizer: Tokenizer | None,
    encoded: list[list[int]],
    params: SamplingParams | Sequence[SamplingParams] | None,
    eos_ids: frozenset[int] | None = None,
) -> tuple[Engine, list[Request]]:
    """An engine whose pool holds exactly these prompts and their budgets, and their
    requests (checked, not yet queued)."""
    if params is None:
        params = SamplingParams()
    params_list = list(params) if isinstance(params, Sequence) else [params] * len(encoded)
    if len(params_list) != len(encoded):
        raise QinferError(f"got {len(params_list)} SamplingParams for {len(encoded)} prompts")
    context = model.config.max_position_embeddings
    width = max(len(ids) for ids in encoded)
    if width >= context:
        raise QinferError(
            f"prompt has {width} tokens; the model's context ({context}) leaves no room to generate"
        )
    block_size = EngineConfig.block_size
    blocks = sum(
        -(-min(len(ids) + p.max_tokens, context) // block_size)
        for ids, p in zip(encoded, params_list, strict=True)
    )
    # Every prompt prefilled in the first step, as one batch call expects (the engine's
    # default chunk of 512 tokens would start some rows decoding a step before the others).
    prompt_tokens = sum(len(ids) for ids in encoded)
    config = EngineConfig(
        num_kv_blocks=blocks,
        max_num_seqs=len(encoded),
        max_num_batched_tokens=max(EngineConfig.max_num_batched_tokens, prompt_tokens),
    )
    engine = Engine(model, tokenizer, config, eos_token_ids=eos_ids)
    requests = [engine.make_request(ids, p) for ids, p in zip(encoded, params_list, strict=True)]
    return engine, requests

"""What several subcommands do alike: load the model the flags name (announced as
`qinfer.model.announcer` says), turn the sampling flags into `SamplingParams`, stream a
reply to the terminal and print its speeds, and build a user message with images."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from qinfer.engine.args import (
    LORA_NAME,
    add_mmproj_argument,
    check_device,
    load_config,
    lora_arguments,
    prompt_cache_arguments,
    speculative_arguments,
)
from qinfer.request.chat_defaults import GENERATE_MAX_TOKENS, chat_sampling_params

if TYPE_CHECKING:  # the heavy imports wait until a subcommand needs them
    from qinfer.engine.generation import GenerationResult, Prompt, TextStream
    from qinfer.engine.llm import EngineTextStream
    from qinfer.model.announcer import LoadAnnouncer
    from qinfer.model.transformer import Transformer
    from qinfer.request.sampling import SamplingParams
    from qinfer.text.tokenizer import Tokenizer

    #: One prompt in, its text deltas out (`.result` once read).
    Streamer = Callable[[Prompt, SamplingParams], TextStream | EngineTextStream]


def load_model_and_tokenizer(
    args: argparse.Namespace,
) -> tuple[Path, Transformer, Tokenizer]:
    """(path, model, tokenizer) for --model / --dtype / --device / --quantize / --group-size,
    announced as `qinfer.model.announcer` says."""
    path, announcer = start_loading(args)
    from qinfer.model.loading import load_model
    from qinfer.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)  # before the model: a missing tokenizer fails fast
    model = load_model(path, **load_config(args).model_arguments())
    announcer.finished(model)
    return path, model, tokenizer


def start_loading(args: argparse.Namespace) -> tuple[Path, LoadAnnouncer]:
    """The checkpoint's path once --model and --device are known good; the load announced."""
    from qinfer.core.checkpoint import resolve_model
    from qinfer.model.announcer import LoadAnnouncer, display_name

    path = resolve_model(args.model)
    announcer = LoadAnnouncer(display_name(args.model, path), path)
    announcer.started()  # before torch's import: the first second is not silent
    check_device(args)
    return path, announcer


def load_streamer(args: argparse.Namespace) -> tuple[Path, Tokenizer, Streamer]:
    """(path, tokenizer, stream) for the model flags: at --tensor-parallel-size 1 the plain
    generator over a loaded model (`stream_generate`); above, with speculative decoding
    (whose draft model loads once) or with --image (a vision-language checkpoint's tower
    loads with it), a batching engine whose rank 0 this process is (`LLM.stream`), its
    workers following each step; so with --prompt-cache-dir (the engine's prefix cache) and
    with --lora (the engine's adapters)."""
    speculative = speculative_arguments(args)
    prompt_cache = prompt_cache_arguments(args)
    lora = lora_arguments(args)
    # images need the engine's vision tower, which a checkpoint's engine loads
    images = args.image or args.mmproj
    plain = speculative is None and not images and not prompt_cache and not lora
    if args.tensor_parallel_size == 1 and plain:
        path, model, tokenizer = load_model_and_tokenizer(args)  # announced before torch's import
        from qinfer.engine.generation import stream_generate

        return path, tokenizer, partial(stream_generate, model, tokenizer)
    path, announcer = start_loading(args)
    from qinfer.engine.llm import LLM
    from qinfer.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)  # before the model: a missing tokenizer fails fast
    llm = LLM(
        path,
        tokenizer,
        load=load_config(args),
        speculative=speculative,
        **prompt_cache,
        **lora,
    )
    announcer.finished(llm.engine.executor.model)
    return path, tokenizer, partial(llm.stream, lora=LORA_NAME if lora else None)


def sampling_params(args: argparse.Namespace, path: Path, *, chat: bool = False) -> SamplingParams:
    """The sampling flags given, over the checkpoint's generation_config.json, over the
    command's defaults: `chat` samples (`chat_defaults.chat_sampling_params`, as the
    server's chat endpoint does); `generate` keeps `SamplingParams.from_generation_config`'s
    rule (greedy without a generation config, as transformers and the engine)."""
    flags = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )
    if chat:
        return chat_sampling_params(path, **flags)
    from qinfer.request.sampling import SamplingParams

    flags["max_tokens"] = args.max_tokens or GENERATE_MAX_TOKENS
    return SamplingParams.from_generation_config(path, **flags)


def stream_to(out: TextIO, stream: TextStream, shown: list[str] | None = None) -> None:
    """Write a TextStream's deltas as they come, then a newline; each delta is added to
    `shown` as it is written (what was on screen when a Ctrl-C stopped the stream)."""
    try:
        for delta in stream:
            if shown is not None:
                shown.append(delta)
            out.write(delta)
            out.flush()
    finally:
        out.write("\n")
        out.flush()


def print_stats(result: GenerationResult) -> None:
    """Token counts and speeds of one GenerationResult, on stderr (stdout holds the text)."""
    t = result.timings
    print(
        f"[{result.prompt_tokens} prompt tokens, {result.generated_tokens} generated; "
        f"prefill {t.prefill_tokens_per_second:.1f} tok/s, "
        f"decode {t.decode_tokens_per_second:.1f} tok/s; finish: {result.finish_reason}]",
        file=sys.stderr,
    )


def add_image_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image the (first) user message shows, before its text, for a "
        "vision-language checkpoint (Qwen2.5-VL, Qwen3-VL); repeat for several",
    )
    add_mmproj_argument(parser)


def user_message(text: str, images: list[str]) -> dict:
    """A user message of `text`, after the content parts of `images` (paths) if any."""
    if not images:
        return {"role": "user", "content": text}
    parts = [{"type": "image", "image": path} for path in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}

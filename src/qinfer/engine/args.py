"""Command-line flags several `qinfer` subcommands share: which model to load and how to
sample. cli/ and server/command.py both add them from here.

Flags are checked by their argparse types, while the command line is parsed: a bad value
is refused in milliseconds, naming the flag, before torch is imported or a model loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from qinfer.core.features import KV_CACHE_DTYPES
from qinfer.engine.config import parse_byte_size
from qinfer.request.chat_defaults import CHAT_DEFAULTS, GENERATE_MAX_TOKENS

if TYPE_CHECKING:
    from qinfer.engine.build import LoadConfig


def bounded(
    kind: type,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
) -> Callable[[str], float | int]:
    """An argparse type: `kind(text)` within [low, high] (low excluded when low_open)."""

    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {_noun(kind)}, got {text!r}") from None
        if isinstance(value, float) and math.isnan(value):
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}")
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_range(low, high, low_open)}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


def one_of(names: tuple[str, ...]) -> Callable[[str], str]:
    """An argparse type: a text that is one of `names`."""

    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(names)}, got {text!r}")
        return text

    parse.__name__ = "name"
    return parse


def byte_size(text: str) -> int:
    """An argparse type: `parse_byte_size`."""
    try:
        return parse_byte_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _noun(kind: type) -> str:
    return "an integer" if kind is int else "a number"


def _range(low: float | None, high: float | None, low_open: bool) -> str:
    if high is None:
        return f"> {low}" if low_open else f">= {low}"
    if low is None:
        return f"<= {high}"
    return f"in {'(' if low_open else '['}{low}, {high}]"


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="a checkpoint folder, a .gguf file or a hub id (default: the embedded SmolLM2-135M)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="compute dtype: float32, bfloat16 or float16 (default: chosen by this device's CPU class; "
        "float32 dequantizes a GGUF file, the exact reference)",
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: best)")
    parser.add_argument(
        "--quantize",
        default=None,
        choices=["none", "int8", "int4"],
        help="weight-only quantization at load (default: a GGUF file keeps its quantized "
        "blocks, other weights stay dense; none: everything dense)",
    )
    parser.add_argument(
        "--group-size",
        type=bounded(int, 1),
        default=32,
        help="input columns per int4 scale (32 to 256)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="how the KV cache stores keys and values: auto (the compute dtype; bf16 for a "
        "GGUF file computing in fp32), bf16, or "
        "int8 / fp8 with one scale per 32 elements of a token's head (about 0.56x bf16's "
        "memory, 1.78x the sequences in the same pool; default: auto)",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's tokens and logprobs do not depend on what runs beside it, even "
        "with chunked prefill, prefix-cache hits, preemption or speculative decoding "
        "(slower prefill: every query takes decode's attention; see Features)",
    )
    parser.add_argument(
        "--exact",
        action="store_true",
        help="multiply quantized weights by the activations as they are (fp32), the reference "
        "mode; by default they are rounded to int8 per block of 32 and multiplied on integer "
        "dot products on CPU, as llama.cpp does (faster, with less drift from fp32 than "
        "llama.cpp's)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=bounded(int, 1),
        default=1,
        metavar="N",
        help="split the model over N processes (one GPU each on CUDA): N - 1 workers are "
        "spawned here, or, under torchrun, its ranks are used (default: 1)",
    )


def add_mmproj_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mmproj",
        default=None,
        metavar="FILE",
        help="llama.cpp's projector file (mmproj GGUF) of a Qwen2.5-VL or Qwen3-VL GGUF "
        "--model: its vision tower, for --image and image parts",
    )


def load_config(args: argparse.Namespace) -> LoadConfig:
    """How the checkpoint loads, from the flags of `add_model_arguments` (and
    `add_mmproj_argument`, where the command has it)."""
    from qinfer.engine.build import LoadConfig  # torch: imported only when a command runs

    # each flag's destination is the field's name (--dtype: dtype, ... --mmproj: mmproj)
    names = [field.name for field in dataclasses.fields(LoadConfig)]
    return LoadConfig(**{name: getattr(args, name) for name in names if hasattr(args, name)})


def check_device(args: argparse.Namespace) -> None:
    """Refuse a --device this torch cannot use, naming the flag, before anything loads."""
    from qinfer.core.errors import QinferError  # torch below: imported only when a command runs

    if args.device is None:
        return
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise QinferError(
            f"--device {args.device}: not a device; use cpu, cuda, cuda:N or mps"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU found"
        raise QinferError(f"--device {args.device}: {why}; use --device cpu (or leave it out)")
    if device.type == "cuda" and device.index is not None:
        count = torch.cuda.device_count()
        if device.index >= count:
            raise QinferError(f"--device {args.device}: this machine has {count} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise QinferError(f"--device {args.device}: MPS is not available here")


def add_sampling_arguments(parser: argparse.ArgumentParser, *, chat: bool) -> None:
    """Sampling flags. Those left unset come from the checkpoint's generation_config.json,
    then from the command's defaults: `chat` samples (chat_defaults.CHAT_DEFAULTS),
    `generate` decodes greedily as transformers does."""
    if chat:
        temperature = CHAT_DEFAULTS["temperature"]
        defaults = f"default: the checkpoint's generation_config.json, else {temperature}"
        max_tokens = CHAT_DEFAULTS["max_tokens"]
    else:
        defaults = "default: the checkpoint's generation_config.json, else 0 (greedy)"
        max_tokens = GENERATE_MAX_TOKENS
    parser.add_argument(
        "--max-tokens",
        type=bounded(int, 1),
        default=None,
        help=f"new tokens at most (default: {max_tokens})",
    )
    parser.add_argument(
        "--temperature", type=bounded(float, 0.0), default=None, help=f"0 = greedy ({defaults})"
    )
    parser.add_argument(
        "--top-p",
        type=bounded(float, 0.0, 1.0, low_open=True),
        default=None,
        help="keep the most likely tokens up to this probability"
        + (f" (chat default: {CHAT_DEFAULTS['top_p']})" if chat else ""),
    )
    parser.add_argument(
        "--top-k", type=bounded(int, 0), default=None, help="keep the k most likely (0 = off)"
    )
    parser.add_argument(
        "--repetition-penalty",
        type=bounded(float, 0.0, low_open=True),
        default=None,
        help="> 1 discourages repeating the conversation's tokens"
        + (f" (chat default: {CHAT_DEFAULTS['repetition_penalty']})" if chat else " (1 = off)"),
    )
    parser.add_argument(
        "--seed", type=bounded(int, 0), default=None, help="make sampling reproducible"
    )
    parser.add_argument("--system", default=None, help="a system message for the chat template")


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding flags (`qinfer.engine.speculative`); none given: off."""
    group = parser.add_argument_group("speculative decoding")
    group.add_argument(
        "--speculative-method",
        choices=["ngram", "draft", "mtp"],
        default=None,
        help="propose tokens for the model to verify: ngram (prompt lookup: copy what "
        "followed the last tokens earlier on), draft (a draft model; default with "
        "--speculative-model) or mtp (the checkpoint's own multi-token-prediction head: "
        "Qwen3.5 / Qwen3.6)",
    )
    group.add_argument(
        "--speculative-model",
        default=None,
        metavar="PATH",
        help="the draft model's checkpoint (same vocabulary; the target's own GGUF drafts "
        "for a float32 or bfloat16 target)",
    )
    group.add_argument(
        "--num-speculative-tokens",
        type=bounded(int, 1),
        default=None,
        metavar="K",
        help="tokens proposed per step at most (default: 4)",
    )


def add_lora_argument(parser: argparse.ArgumentParser) -> None:
    """`qinfer generate` / `chat`'s adapter (`qinfer serve` names its own: --lora-modules)."""
    parser.add_argument(
        "--lora",
        default=None,
        metavar="DIR",
        help="a PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors) "
        "the replies run through (default: the base model)",
    )


#: The name `--lora`'s adapter is loaded under (the engine's requests name their adapter).
LORA_NAME = "lora"


def lora_arguments(args: argparse.Namespace) -> dict:
    """The engine arguments of --lora (none when it is not given)."""
    return {} if args.lora is None else {"lora_modules": {LORA_NAME: args.lora}}


def add_prompt_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The prefix cache's disk tier (`qinfer.engine.disk_cache`)."""
    group = parser.add_argument_group("prompt cache on disk")
    group.add_argument(
        "--prompt-cache-dir",
        default=None,
        metavar="DIR",
        help="keep the K/V blocks of finished prompts in DIR too, so that a restart or "
        "another process on this machine reads them instead of recomputing them "
        "(default: memory only)",
    )
    group.add_argument(
        "--prompt-cache-size",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="the most DIR holds, least recently used blocks removed first (default: 10GB)",
    )


def prompt_cache_arguments(args: argparse.Namespace) -> dict:
    """The engine arguments of `add_prompt_cache_arguments`' flags (those given)."""
    from qinfer.core.errors import QinferError

    if args.prompt_cache_dir is None and args.prompt_cache_size is not None:
        raise QinferError("--prompt-cache-size needs --prompt-cache-dir")
    names = ("prompt_cache_dir", "prompt_cache_size")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def speculative_arguments(args: argparse.Namespace) -> dict | None:
    """The engine's `speculative` settings from the flags of `add_speculative_arguments`,
    or None when speculation is off; a flag that needs another names it."""
    from qinfer.core.errors import QinferError

    method = args.speculative_method
    if method is None and args.speculative_model is not None:
        method = "draft"
    if method is None:
        if args.num_speculative_tokens is not None:
            raise QinferError(
                "--num-speculative-tokens needs --speculative-method (ngram, draft or mtp)"
            )
        return None
    if method == "draft" and args.speculative_model is None:
        raise QinferError("--speculative-method draft needs --speculative-model")
    if method != "draft" and args.speculative_model is not None:
        raise QinferError("--speculative-model needs --speculative-method draft")
    settings: dict = {"method": method}
    if args.speculative_model is not None:
        settings["model"] = args.speculative_model
    if args.num_speculative_tokens is not None:
        settings["num_speculative_tokens"] = args.num_speculative_tokens
    return settings

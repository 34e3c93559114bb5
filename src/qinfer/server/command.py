"""`qinfer serve`: its command-line arguments, and the server they start.

Kept apart from the app so that building the `qinfer` parser does not import FastAPI.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from qinfer.core.errors import QinferError
from qinfer.core.features import ATTENTION_BACKENDS, LORA_DTYPES
from qinfer.engine.args import (
    add_mmproj_argument,
    add_model_arguments,
    add_prompt_cache_arguments,
    add_speculative_arguments,
    bounded,
    check_device,
    load_config,
    one_of,
    prompt_cache_arguments,
    speculative_arguments,
)
from qinfer.request.pooling import POOLING_METHODS, PoolingParams

#: What `qinfer serve --task` chooses from (`qinfer.server.model_server.ServerSettings.task`).
TASKS = ("generate", "embed", "rerank")

#: Engine arguments as flags: (flag, EngineConfig field, type, help).
ENGINE_FLAGS = [
    ("--max-num-seqs", "max_num_seqs", bounded(int, 1), "sequences batched in one step"),
    (
        "--max-num-batched-tokens",
        "max_num_batched_tokens",
        bounded(int, 1),
        "tokens run in one step",
    ),
    (
        "--max-model-len",
        "max_model_len",
        bounded(int, 1),
        "longest prompt + output (default: the context)",
    ),
    ("--block-size", "block_size", bounded(int, 1), "tokens per KV block"),
    ("--num-kv-blocks", "num_kv_blocks", bounded(int, 1), "exact KV pool size in blocks"),
    ("--kv-cache-memory", "kv_cache_memory", bounded(int, 1), "bytes for the KV pool"),
    (
        "--attention-backend",
        "attention_backend",
        one_of(ATTENTION_BACKENDS),
        "paged (the CPU's) or gathered (one sdpa over gathered blocks); default: auto",
    ),
    (
        "--max-waiting-requests",
        "max_waiting_requests",
        bounded(int, 0),
        "queued requests before 503",
    ),
    ("--max-loras", "max_loras", bounded(int, 1), "LoRA adapters resident at once (default 4)"),
    ("--max-lora-rank", "max_lora_rank", bounded(int, 1), "largest LoRA rank (default 64)"),
    (
        "--lora-dtype",
        "lora_dtype",
        one_of(LORA_DTYPES),
        "what adapters are held in: auto (fp32 on the CPU), float32 or bfloat16",
    ),
]


def host_name(text: str) -> str:
    """An argparse type: one host of --allowed-media-domains (`images.media_domain`)."""
    from qinfer.server.images import media_domain  # the server's modules load on serve only

    try:
        return media_domain(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object such as '{"enable_thinking": false}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """`qinfer serve`'s flags: the model's (what loads), the server's (where it listens,
    who may call), the task's, then the engine's."""
    add_model_arguments(parser)
    add_mmproj_argument(parser)
    add_speculative_arguments(parser)
    add_prompt_cache_arguments(parser)
    add_server_arguments(parser)
    add_task_arguments(parser)
    add_engine_arguments(parser)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the server listens, who may call it, and what it says it serves."""
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    parser.add_argument(
        "--port", type=bounded(int, 1, 65535), default=8000, help="default: %(default)s"
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on the /v1 routes (repeat for several keys)",
    )
    parser.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="read API keys from FILE, one per line (with --api-key: both sets are accepted)",
    )
    parser.add_argument(
        "--allowed-origins",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="let web pages from ORIGIN call the API (CORS), e.g. http://localhost:3000; "
        "repeat for several, '*' for any (default: none)",
    )
    parser.add_argument(
        "--allowed-media-domains",
        nargs="+",
        action="extend",
        type=host_name,
        default=None,
        metavar="HOST",
        help="fetch http(s) image URLs of these hosts (exact names, e.g. images.example.com; "
        "default: none, only data URLs and base64 images are read)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: the checkpoint's folder or file name)",
    )
    parser.add_argument(
        "--chat-template-kwargs",
        type=json_object,
        default=None,
        help="server-wide chat template variables, e.g. '{\"enable_thinking\": false}'",
    )
    parser.add_argument(
        "--reasoning-budget",
        type=bounded(int, 0),
        default=None,
        metavar="N",
        help="a thinking model's <think> block takes at most N tokens, then </think> is "
        "forced and the answer follows (a request's thinking_token_budget overrides it; "
        "default: unbounded)",
    )


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    """What the server does with the model (--task) and how it pools embeddings."""
    parser.add_argument(
        "--task",
        choices=TASKS,
        default=None,
        help="serve generation (chat, completions, responses, messages, and the others), "
        "embeddings only (embed) or rerank and score only (rerank) (default: rerank for a "
        "checkpoint named like Qwen3-Reranker, embed for one named like Qwen3-Embedding, "
        "else generate)",
    )
    embeddings = parser.add_argument_group("embeddings (POST /v1/embeddings)")
    embeddings.add_argument(
        "--pooling",
        choices=POOLING_METHODS,
        default="last",
        help="pool a prompt's final hidden states by its last token (Qwen3-Embedding's), "
        "their mean, or the first token (default: %(default)s)",
    )
    embeddings.add_argument(
        "--no-normalize",
        dest="normalize",
        action="store_false",
        help="do not L2-normalise embeddings",
    )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The batching engine's settings (`EngineConfig`)."""
    engine = parser.add_argument_group("engine")
    for flag, name, kind, help_text in ENGINE_FLAGS:
        engine.add_argument(flag, dest=name, type=kind, default=None, help=help_text)
    engine.add_argument(
        "--static-decode",
        action="store_true",
        default=None,
        help="decode steps padded to buckets of fixed shapes, no tensor made per step "
        "(what a CUDA graph captures; the gathered attention backend)",
    )
    engine.add_argument(
        "--cuda-graphs",
        action="store_true",
        default=None,
        help="replay each decode bucket as a CUDA graph (default on a CUDA device)",
    )
    engine.add_argument(
        "--enforce-eager",
        dest="cuda_graphs",
        action="store_false",
        default=None,
        help="no CUDA graphs: every step runs eagerly",
    )
    engine.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        type=lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) to serve, each a model requests name",
    )
    engine.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )
    engine.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="do not reuse the K/V of shared prompt prefixes",
    )


def lora_module(text: str) -> tuple[str, str]:
    """--lora-modules' NAME=PATH, as (name, path)."""
    name, equals, path = text.partition("=")
    if not equals or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    return name, path


def api_keys(args: argparse.Namespace) -> list[str] | None:
    """The keys of --api-key and --api-key-file (blank lines skipped), or None for none."""
    keys = list(args.api_key or ())
    if args.api_key_file is not None:
        try:
            text = args.api_key_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            reason = getattr(error, "strerror", None) or str(error)
            raise QinferError(
                f"--api-key-file: cannot read {args.api_key_file}: {reason}"
            ) from None
        from_file = [line.strip() for line in text.splitlines() if line.strip()]
        if not from_file:
            raise QinferError(f"--api-key-file: {args.api_key_file} holds no key (one per line)")
        keys += from_file
    if any(not key.strip() for key in keys):
        raise QinferError("--api-key: a key must not be empty")
    return keys or None


def run_serve(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C (status 0) or SIGTERM; the address and device are checked before
    the model loads."""
    from qinfer.server.lifecycle import check_address

    check_address(args.host, args.port)
    check_device(args)
    from qinfer.server.app import serve

    engine_args = {name: getattr(args, name) for _, name, _, _ in ENGINE_FLAGS}
    engine_args["static_decode"] = args.static_decode
    engine_args["cuda_graphs"] = args.cuda_graphs
    engine_args = {name: value for name, value in engine_args.items() if value is not None}
    engine_args["speculative"] = speculative_arguments(args)
    if args.lora_modules:
        engine_args["lora_modules"] = dict(args.lora_modules)
    engine_args |= prompt_cache_arguments(args)
    serve(
        args.model,
        host=args.host,
        port=args.port,
        api_key=api_keys(args),
        allowed_origins=args.allowed_origins or (),
        allowed_media_domains=args.allowed_media_domains or (),
        served_model_name=args.served_model_name,
        chat_template_kwargs=args.chat_template_kwargs,
        load=load_config(args),
        enable_prefix_caching=args.enable_prefix_caching,
        pooling=PoolingParams(args.pooling, args.normalize),
        task=args.task,
        allow_runtime_lora=args.allow_runtime_lora,
        reasoning_budget=args.reasoning_budget,
        **engine_args,
    )
    return 0

"""Command-line flags several `qinfer` subcommands share: which model to load and how to
sample. cli.py and server/command.py both add them from here."""

from __future__ import annotations

import argparse


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="a checkpoint folder, a .gguf file or a hub id (default: the embedded SmolLM2-135M)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="compute dtype: float32, bfloat16 or float16 (default: measured for this device; "
        "float32 dequantizes a GGUF file, the exact reference)",
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: best)")
    parser.add_argument(
        "--quantize",
        default=None,
        choices=["none", "int8", "int4"],
        help="weight-only quantization at load (default: a GGUF file keeps its Q4/Q8 blocks, "
        "other weights stay dense; none: everything dense)",
    )
    parser.add_argument(
        "--group-size", type=int, default=32, help="input columns per int4 scale (32 to 256)"
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N processes (one GPU each on CUDA): N - 1 workers are "
        "spawned here, or, under torchrun, its ranks are used (default: 1)",
    )


def load_arguments(args: argparse.Namespace) -> dict:
    """`qinfer.load_model`'s keywords from the flags of `add_model_arguments`."""
    return {
        "dtype": args.dtype,
        "device": args.device,
        "quantize": args.quantize,
        "group_size": args.group_size,
    }


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """Sampling flags; those left unset come from the checkpoint's generation config."""
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens at most")
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy (default: the checkpoint's generation_config.json; 1 without one)",
    )
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None, help="make sampling reproducible")
    parser.add_argument("--system", default=None, help="a system message for the chat template")

"""`qinfer bench`: prefill and decode speed, memory and weight bandwidth on this machine
(`qinfer.bench` measures; this module reads the flags and prints)."""

from __future__ import annotations

import argparse
import json

from qinfer.core.errors import QinferError
from qinfer.engine.args import (
    add_model_arguments,
    add_speculative_arguments,
    bounded,
    load_config,
    speculative_arguments,
)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_speculative_arguments(parser)
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prefill length")
    parser.add_argument(
        "--decode-tokens",
        type=bounded(int, 1),
        default=None,
        help="tokens decoded per row (default: 32; with speculative decoding, at most 192 "
        "per request)",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="rows of the batched decode")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; the best counts")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument("--compare-hf", action="store_true", help="also run transformers")
    parser.add_argument(
        "--batch",
        action="store_true",
        help="64 mixed requests: batching engine vs one by one (see bench/bench_engine.py)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_bench(args: argparse.Namespace) -> int:
    import torch

    from qinfer.bench import (
        BenchSettings,
        format_engine_report,
        format_report,
        run_benchmarks,
        run_engine_benchmark,
    )

    if args.threads is not None:
        if args.threads < 1:
            raise QinferError(f"--threads must be at least 1, got {args.threads}")
        # On a shared machine, fewer threads than cores avoids OpenMP threads spinning
        # while their partners wait to be scheduled.
        torch.set_num_threads(args.threads)
    speculative = speculative_arguments(args)
    if speculative is not None:
        from qinfer.bench.speculative import format_speculative_report, run_speculative_benchmark

        report = run_speculative_benchmark(
            args.model,
            load_config(args).model_arguments(),
            speculative,
            repeats=args.repeats,
            max_tokens=args.decode_tokens or 192,
        )
        print(json.dumps(report, indent=2) if args.json else format_speculative_report(report))
        return 0
    if args.batch:
        report = run_engine_benchmark(
            args.model,
            load_config(args).model_arguments(),
            compare_hf=args.compare_hf,
            tensor_parallel_size=args.tensor_parallel_size,
        )
        print(json.dumps(report, indent=2) if args.json else format_engine_report(report))
        return 0
    if args.tensor_parallel_size != 1:
        raise QinferError("bench runs the model in one process: use --batch (the engine) at TP > 1")
    settings = BenchSettings(
        prompt_tokens=args.prompt_tokens,
        decode_tokens=args.decode_tokens or 32,
        batch_size=args.batch_size,
        repeats=args.repeats,
    )
    report = run_benchmarks(
        args.model, load_config(args).model_arguments(), settings, args.compare_hf
    )
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0

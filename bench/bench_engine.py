"""Output tokens/s of the batching engine on mixed requests, against one-by-one and transformers.

    python bench/bench_engine.py                       # the embedded SmolLM2 GGUF
    python bench/bench_engine.py --model /tmp/qwen3-0.6b-random --compare-hf --json

See `qinfer.bench.engine` for what is measured.
"""

from __future__ import annotations

import argparse
import json

import torch

from qinfer.bench import Workload, format_engine_report, run_engine_benchmark
from qinfer.engine.args import add_model_arguments, load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--prompt-tokens", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--output-tokens", type=int, nargs=2, default=(8, 64), metavar=("MIN", "MAX")
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--skip-one-by-one", action="store_true")
    parser.add_argument("--compare-hf", action="store_true", help="also run transformers")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    workload = Workload(args.num_requests, *args.prompt_tokens, *args.output_tokens)
    report = run_engine_benchmark(
        args.model,
        load_config(args).model_arguments(),
        workload,
        compare_hf=args.compare_hf,
        one_by_one=not args.skip_one_by_one,
        tensor_parallel_size=args.tensor_parallel_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    print(json.dumps(report, indent=2) if args.json else format_engine_report(report))


if __name__ == "__main__":
    main()

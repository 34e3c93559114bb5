"""Tensor parallelism against one process: output tokens/s and greedy parity of the engine.

    python bench/bench_tensor_parallel.py --model path/to/Qwen3-8B --tensor-parallel-size 2
    python bench/bench_tensor_parallel.py --model /tmp/qwen3-0.6b --dtype float32 --device cpu

The same mixed greedy workload (`qinfer.bench.Workload`) runs through `qinfer.LLM` at one
rank, then at N ranks (gloo on CPU; NCCL on CUDA, one GPU per rank: cuda:0..N-1). Parity:
how many requests produced exactly the same tokens, and the first position where the
others differ (bf16 sums added in another order may flip a near-tie: exact in fp32).
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from qinfer import LLM, SamplingParams
from qinfer.bench import Workload
from qinfer.bench.common import time_once
from qinfer.engine.args import add_model_arguments, load_config


def run(model: str | None, load_args: dict, size: int, workload: Workload) -> dict:
    """Tokens/s of the workload at `size` ranks, and every request's tokens."""
    llm = LLM(model, tensor_parallel_size=size, **load_args)
    prompts, lengths = workload.draw(llm.engine.model.config.vocab_size)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in lengths]
    llm.generate(prompts[:2], [p.replace(max_tokens=2) for p in params[:2]], use_tqdm=False)
    outputs = []
    seconds = time_once(
        lambda: outputs.extend(llm.generate(prompts, params, use_tqdm=False)),
        llm.engine.model.device,
    )
    llm.close()
    return {
        "output_tokens_per_second": sum(lengths) / seconds,
        "seconds": seconds,
        "tokens": [out.token_ids for out in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.tensor_parallel_size < 2:
        parser.error("give --tensor-parallel-size N with N >= 2")
    workload = Workload(num_requests=args.num_requests)
    single = run(args.model, load_config(args).model_arguments(), 1, workload)
    gc.collect()  # the single-process model, before rank 0's shard loads
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    split = run(
        args.model, load_config(args).model_arguments(), args.tensor_parallel_size, workload
    )
    pairs = list(zip(single.pop("tokens"), split.pop("tokens"), strict=True))
    differing = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
        for x, y in pairs
    ]
    report = {
        "tensor_parallel_size": args.tensor_parallel_size,
        "tp1": single,
        f"tp{args.tensor_parallel_size}": split,
        "speedup": round(split["output_tokens_per_second"] / single["output_tokens_per_second"], 3),
        "identical_requests": sum(d is None for d in differing),
        "requests": len(pairs),
        "first_differing_positions": [d for d in differing if d is not None],
    }
    print(
        json.dumps(report, indent=2)
        if args.json
        else "\n".join(f"{key}: {value}" for key, value in report.items())
    )


if __name__ == "__main__":
    main()

"""The one prepared GPU run: correctness against the CPU in fp32, then nano-vllm's benchmark.

    python bench/cuda_check.py --out $OUT          # on a machine with a CUDA device

1. Correctness. A random Qwen3-0.6B-shaped checkpoint (bench/make_qwen3_0p6b.py's shapes,
   with 4 layers so that the CPU reference stays quick) in fp32: the logits of one forward
   on CUDA against the CPU's (max abs difference), then the engine's greedy tokens on CUDA
   eager, CUDA with CUDA graphs, and the CPU, for prompts of mixed lengths decoding in a
   shrinking batch (every bucket of the static decode step).
2. Speed. nano-vllm's benchmark (its bench.py): 256 requests, random prompts of 100-1024
   tokens, 100-1024 output tokens each (ignore_eos), on the full Qwen3-0.6B-shaped random
   checkpoint in bf16, through `LLM.generate`; output tokens/s eager and with CUDA graphs.
   nano-vllm published 1,434 tok/s (vLLM 1,362) on an RTX 4070 laptop GPU.

Everything is written to OUT/cuda_check.json as it is measured, so a run cut by its time
limit still reports what it finished. Each phase has its own time budget.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from make_qwen3_0p6b import QWEN3_0P6B  # noqa: E402

import qinfer  # noqa: E402
from qinfer import SamplingParams  # noqa: E402


def save_random(folder: Path, dtype: torch.dtype, **overrides) -> Path:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**{**QWEN3_0P6B, **overrides})
    model = transformers.Qwen3ForCausalLM(config).to(dtype).eval()
    model.save_pretrained(folder)
    return folder


def greedy(path: Path, device: str, prompts, lengths, **engine_args) -> list[list[int]]:
    """Greedy tokens of each prompt (its own max_tokens) through the engine, in fp32."""
    llm = qinfer.LLM(path, dtype="float32", device=device, **engine_args)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [out.token_ids for out in outputs]


def correctness(folder: Path, report: dict, device: str) -> None:
    """fp32 logits and greedy tokens on `device` against the CPU's."""
    path = save_random(folder / "small", torch.float32, num_hidden_layers=4)
    tokens = torch.randint(0, 151936, (2, 64), generator=torch.Generator().manual_seed(1))
    cpu = qinfer.load_model(path, dtype="float32", device="cpu")
    other = qinfer.load_model(path, dtype="float32", device=device)
    diff = (cpu(tokens) - other(tokens.to(device)).cpu()).abs().max().item()
    report["logits_max_abs_diff_fp32"] = diff
    rng = random.Random(2)
    prompts = [[rng.randrange(151936) for _ in range(n)] for n in (5, 40, 17, 90, 9, 33)]
    lengths = [6 + 5 * i for i in range(len(prompts))]  # finish one after another
    reference = greedy(path, "cpu", prompts, lengths)
    for name, args in {"eager": {"cuda_graphs": False}, "graphs": {"cuda_graphs": True}}.items():
        tokens = greedy(path, device, prompts, lengths, **args)
        same = sum(a == b for a, b in zip(tokens, reference, strict=True))
        report[f"greedy_{name}_same_as_cpu"] = f"{same}/{len(prompts)}"


def nano_vllm_bench(folder: Path, report: dict, graphs: bool, budget: float) -> None:
    """Output tokens/s of nano-vllm's workload, in rounds of 64 requests until `budget` s."""
    path = folder / "full"
    if not path.exists():
        save_random(path, torch.bfloat16)
    rng = random.Random(0)
    n = 256
    prompts = [[rng.randrange(10000) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    outputs = [rng.randint(100, 1024) for _ in range(n)]
    params = [SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True) for m in outputs]
    llm = qinfer.LLM(
        path,
        dtype="bfloat16",
        device="cuda",
        cuda_graphs=graphs,
        max_num_seqs=64,
        max_num_batched_tokens=16384,
    )
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    # as many requests as the budget allows, measured on what finished
    start = time.perf_counter()
    done = 0
    generated = 0
    for i in range(0, n, 64):
        out = llm.generate(prompts[i : i + 64], params[i : i + 64], use_tqdm=False)
        generated += sum(len(o.token_ids) for o in out)
        done += len(out)
        if time.perf_counter() - start > budget:
            break
    seconds = time.perf_counter() - start
    report[f"bench_{'graphs' if graphs else 'eager'}"] = {
        "requests": done,
        "output_tokens": generated,
        "seconds": round(seconds, 2),
        "tok_per_s": round(generated / seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--bench-seconds", type=float, default=120.0)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of phase 1 alone")
    args = parser.parse_args()
    on_gpu = args.device == "cuda"
    name = torch.cuda.get_device_name(0) if on_gpu else args.device
    report: dict = {"device": name, "torch": torch.__version__}
    out = args.out / "cuda_check.json"

    def save() -> None:
        out.write_text(json.dumps(report, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        phases = [lambda: correctness(Path(tmp), report, args.device)]
        if on_gpu:
            phases += [
                lambda: nano_vllm_bench(Path(tmp), report, True, args.bench_seconds),
                lambda: nano_vllm_bench(Path(tmp), report, False, args.bench_seconds),
            ]
        for phase in phases:
            try:
                phase()
            except Exception:  # noqa: BLE001 (the report says which phase failed, and where)
                report.setdefault("errors", []).append(traceback.format_exc()[-3000:])
            save()
            print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()

"""What LoRA adapters cost at decode: a batch of --batch sequences through --adapters random
adapters of rank --rank (every attention and MLP projection targeted; sequence b through
adapter b % adapters) against the same batch through the base model alone, on the same
model in the same run, alternating rounds:

    python bench/lora_batch.py [--model M] [--batch 8] [--adapters 4] [--rank 16]
                               [--steps 16] [--repeats 3] [--threads 2]
                               [--lora-dtype auto|float32|bfloat16]

--model: a checkpoint (default: random weights shaped like Qwen3-0.6B, built in memory, in
the CPU's compute dtype). --lora-dtype: what the adapters are held in (the engine's
lora_dtype; auto is fp32 on the CPU). Printed as JSON: best decode step ms of each, their
ratio, the median of each round's own ratio (steadier on a shared machine), the adapters'
bytes, and the CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from qinfer import load_model
from qinfer.core.features import LORA_DTYPES
from qinfer.linear.compute import cpu_flags
from qinfer.linear.lora import LoraLinear
from qinfer.lora import Adapters, LoraAdapter
from qinfer.model.transformer import Transformer
from qinfer.models import config_from_hf


def random_model() -> Transformer:
    """Qwen3-0.6B's shapes (bench/make_qwen3_0p6b.py), random weights, bf16."""
    from make_qwen3_0p6b import QWEN3_0P6B

    config = config_from_hf({**QWEN3_0P6B, "model_type": "qwen3"})
    return Transformer.random(config, dtype=torch.bfloat16)


def random_adapter(adapters: Adapters, rank: int, seed: int) -> LoraAdapter:
    """An adapter of `rank` on every projection adapters may target."""
    generator = torch.Generator().manual_seed(seed)
    modules = {}
    for name, target in adapters.targets.items():
        a = torch.randn(rank, target.inputs, generator=generator) * 0.01
        b = torch.randn(target.out, rank, generator=generator) * 0.01
        modules[name] = (a, b)
    return LoraAdapter(f"random-{seed}", modules)


def decode_ms(model: Transformer, batch: int, steps: int, slots: list[int | None] | None) -> float:
    """ms per decode step of `batch` rows after a 16-token prompt each."""
    cache = model.make_cache(batch, max_length=16 + steps + 1)
    tokens = torch.randint(0, 1000, (batch, 16), generator=torch.Generator().manual_seed(0))
    logits = model.run_rows(tokens, 0, cache, last_only=True, adapters=slots)
    start = time.perf_counter()
    for i in range(steps):
        step = logits[:, -1].argmax(-1, keepdim=True)
        logits = model.run_rows(step, 16 + i, cache, last_only=True, adapters=slots)
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lora-dtype", default="auto", choices=LORA_DTYPES)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = random_model() if args.model is None else load_model(args.model)
    adapters = Adapters(model, args.adapters, args.rank, args.lora_dtype)
    for i in range(args.adapters):
        adapters.load(f"a{i}", random_adapter(adapters, args.rank, seed=i))
    slots = [adapters.resident[f"a{b % args.adapters}"] for b in range(args.batch)]
    base, mixed = [], []
    with torch.inference_mode():
        for _ in range(args.repeats):  # each round one of each, back to back
            base.append(decode_ms(model, args.batch, args.steps, None))
            mixed.append(decode_ms(model, args.batch, args.steps, slots))
    # a shared machine's load drifts between rounds: the median of each round's own ratio
    ratios = sorted(m / b for b, m in zip(base, mixed, strict=True))
    lora_bytes = sum(
        module.nbytes - module.base.nbytes
        for module in model.modules()
        if isinstance(module, LoraLinear)
    )
    print(
        json.dumps(
            {
                "batch": args.batch,
                "adapters": args.adapters,
                "rank": args.rank,
                "dtype": str(model.dtype),
                "lora_dtype": str(adapters.dtype),
                "base_step_ms": round(min(base), 2),
                "mixed_step_ms": round(min(mixed), 2),
                "ratio": round(min(mixed) / min(base), 3),
                "median_round_ratio": round(ratios[len(ratios) // 2], 3),
                "adapter_mb": round(lora_bytes / 2**20, 1),
                "cpu": platform.processor() or platform.machine(),
                "flags": sorted(cpu_flags())[:8],
            }
        )
    )


if __name__ == "__main__":
    main()

"""Throughput of the batching engine on a mixed workload, against one-by-one and transformers.

    qinfer bench --batch [--model M] [--compare-hf] [--json]
    python bench/bench_engine.py [--model M] [--num-requests 64] [--compare-hf]

The workload: `num_requests` random prompts with random lengths in [min, max] prompt
tokens, each asking for a random number of output tokens in [min, max] (greedy, EOS
ignored, so every engine produces exactly the same number of tokens). Three ways to
serve it, in one process on one model:

- engine: every request given to `qinfer.LLM` at once (continuous batching);
- one by one: each request alone through the plain generator
  `qinfer.engine.generation.generate_ids`;
- transformers (with compare_hf): one left-padded batched `generate` over all requests.
  It cannot stop rows at different lengths, so it runs max(output lengths) steps for
  everyone; only the tokens the requests asked for are counted.

Output tokens/s = tokens the requests asked for / wall seconds, prefill included.

With tensor_parallel_size N > 1 (`--tensor-parallel-size N`) only the engine runs, over N
ranks, and the report adds the bytes each token all-reduces: two (hidden,) vectors per
layer and one for the embedding lookup, in the compute dtype.
"""

from __future__ import annotations

import gc
import random
from dataclasses import asdict, dataclass

import torch

from qinfer.bench.common import (
    describe_setup,
    format_setup,
    load_qinfer,
    load_transformers_model,
    time_once,
)
from qinfer.core.checkpoint import resolve_model
from qinfer.core.errors import QinferError
from qinfer.engine.generation import generate_ids
from qinfer.engine.llm import LLM
from qinfer.request.sampling import SamplingParams


@dataclass(frozen=True)
class Workload:
    """Mixed request lengths, drawn from `seed`."""

    num_requests: int = 64
    min_prompt_tokens: int = 16
    max_prompt_tokens: int = 256
    min_output_tokens: int = 8
    max_output_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for low, high in (
            ("min_prompt_tokens", "max_prompt_tokens"),
            ("min_output_tokens", "max_output_tokens"),
        ):
            if not 1 <= getattr(self, low) <= getattr(self, high):
                raise QinferError(f"need 1 <= {low} <= {high}")
        if self.num_requests < 1:
            raise QinferError(f"num_requests must be at least 1, got {self.num_requests}")

    def draw(self, vocab_size: int) -> tuple[list[list[int]], list[int]]:
        """(prompt token ids, output lengths), one of each per request."""
        rng = random.Random(self.seed)
        prompts = [
            [
                rng.randrange(vocab_size)
                for _ in range(rng.randint(self.min_prompt_tokens, self.max_prompt_tokens))
            ]
            for _ in range(self.num_requests)
        ]
        outputs = [rng.randint(self.min_output_tokens, self.max_output_tokens) for _ in prompts]
        return prompts, outputs


def run_engine_benchmark(
    model_spec: str | None,
    load_args: dict | None = None,
    workload: Workload | None = None,
    compare_hf: bool = False,
    one_by_one: bool = True,
    tensor_parallel_size: int = 1,
    **engine_args,
) -> dict:
    """Measure the workload through the engine, one by one and (compare_hf) transformers;
    a JSON-ready dict with output tokens/s of each and the engine's ratios to the others.
    load_args: `load_model`'s keywords (dtype, device, quantize, ...). tensor_parallel_size
    N > 1: the engine alone, over N ranks."""
    workload = workload or Workload()
    if tensor_parallel_size == 1:
        path, model = load_qinfer(model_spec, load_args)
        llm = LLM(model, **engine_args)
    else:
        if compare_hf:
            raise QinferError("--compare-hf runs in one process: drop --tensor-parallel-size")
        one_by_one = False  # the plain generator runs in one process
        path = resolve_model(model_spec)
        llm = LLM(
            path, tensor_parallel_size=tensor_parallel_size, **(load_args or {}), **engine_args
        )
        model = llm.engine.model
    device = model.device
    prompts, lengths = workload.draw(model.config.vocab_size)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in lengths]
    wanted = sum(lengths)
    report = {
        "model": str(path),
        **describe_setup(model),
        "workload": asdict(workload),
        "output_tokens": wanted,
    }

    if tensor_parallel_size > 1:
        config = model.config
        report["tensor_parallel_size"] = tensor_parallel_size
        report["allreduce_bytes_per_token"] = (
            (2 * config.num_hidden_layers + 1) * config.hidden_size * model.dtype.itemsize
        )
    report["engine"] = _bench_engine(llm, prompts, params, wanted)
    llm.close()
    del llm  # its KV pool, before the other ways run
    if one_by_one:
        seconds = time_once(
            lambda: [generate_ids(model, [p], [sp]) for p, sp in zip(prompts, params, strict=True)],
            device,
        )
        report["one_by_one"] = {"seconds": seconds, "output_tokens_per_second": wanted / seconds}
    if compare_hf:
        model_dtype = model.dtype
        del model
        gc.collect()
        report["transformers"] = _bench_transformers(
            load_transformers_model(path, model_dtype, device), prompts, lengths
        )
    engine_rate = report["engine"]["output_tokens_per_second"]
    for other in ("one_by_one", "transformers"):
        if other in report:
            report[f"engine_over_{other}"] = round(
                engine_rate / report[other]["output_tokens_per_second"], 3
            )
    return report


def _bench_engine(llm: LLM, prompts, params, wanted: int) -> dict:
    """All requests given to one LLM at once (after a small warm-up run)."""
    llm.generate(prompts[:2], [p.replace(max_tokens=2) for p in params[:2]], use_tqdm=False)
    device = llm.engine.model.device
    seconds = time_once(lambda: llm.generate(prompts, params, use_tqdm=False), device)
    stats = llm.engine.stats()
    return {
        "seconds": seconds,
        "output_tokens_per_second": wanted / seconds,
        "preemptions": stats.preemptions_total,
        "kv_blocks_total": stats.kv_blocks_total,
        "engine_args": {k: v for k, v in asdict(llm.engine.config).items() if v is not None},
    }


def _bench_transformers(model, prompts: list[list[int]], lengths: list[int]) -> dict:
    """One left-padded batched greedy generate over every prompt, EOS suppressed."""
    device = model.device
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention[row, width - len(prompt) :] = 1
    ids, attention = ids.to(device), attention.to(device)
    steps = max(lengths)

    def run() -> None:
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=attention,
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                pad_token_id=0,
            )

    seconds = time_once(run, device)
    return {
        "seconds": seconds,
        "output_tokens_per_second": sum(lengths) / seconds,
        "tokens_generated_incl_unwanted": steps * len(prompts),
    }


def format_engine_report(report: dict) -> str:
    """The report as a few lines: tokens/s of each way, and the engine's ratios."""
    w = report["workload"]
    lines = [
        report["model"],
        format_setup(report),
        f"{w['num_requests']} requests: prompts {w['min_prompt_tokens']}-{w['max_prompt_tokens']} "
        f"tokens, outputs {w['min_output_tokens']}-{w['max_output_tokens']} tokens "
        f"({report['output_tokens']} output tokens in all)",
    ]
    if "tensor_parallel_size" in report:
        lines.append(
            f"tensor parallel over {report['tensor_parallel_size']} ranks: "
            f"{report['allreduce_bytes_per_token']} bytes all-reduced per token"
        )
    for name in ("engine", "one_by_one", "transformers"):
        if name in report:
            figures = report[name]
            lines.append(
                f"{name:>14}: {figures['output_tokens_per_second']:9.1f} output tok/s "
                f"({figures['seconds']:.1f} s)"
            )
    for name in ("one_by_one", "transformers"):
        if f"engine_over_{name}" in report:
            lines.append(f"engine / {name}: {report[f'engine_over_{name}']:.2f}x")
    return "\n".join(lines)

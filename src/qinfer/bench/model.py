"""How fast one checkpoint runs: prefill and decode speed, peak memory, weight bandwidth.

    qinfer bench --model M [--prompt-tokens 128] [--decode-tokens 32] [--batch-size 8]
                 [--compare-hf] [--json]

- prefill tok/s: one forward over a random prompt of `prompt_tokens` ids (last-position
  logits only, as generation does).
- decode tok/s: greedy generation of `decode_tokens` tokens after that prompt through
  `qinfer.generate` (sampling, stop checks and all), at batch 1 and at `batch_size` rows
  (for the batch, tokens of all rows per second). The first token, which the prefill
  produced, is not counted.
- weight GB/s: decode at batch 1 reads every weight once per token, so it is bound by
  memory bandwidth: bytes of weights read per step x steps per second, to set against
  the machine's bandwidth. The embedding table is not counted (a step reads one row of
  it) unless it doubles as the lm_head.
- peak memory: what loading the model and running each measurement once added to the
  process: peak RSS (VmHWM, reset before loading where Linux allows) over the RSS before,
  on CPU; `torch.cuda.max_memory_allocated` over the allocated bytes before, on CUDA.
- every speed is the fastest of `repeats` rounds, after that warm-up.

`--compare-hf` measures `transformers` on the same checkpoint (an HF folder, or a GGUF
file through transformers' GGUF loading, which dequantizes it) in the same process and
reports qinfer / transformers ratios. The timed rounds alternate between the two engines:
on a shared machine absolute times are noise, ratios from one run are evidence.
"""

from __future__ import annotations

import functools
import gc
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from qinfer.bench.common import (
    bench_device,
    describe_setup,
    format_setup,
    load_qinfer,
    load_transformers_model,
    synchronize,
    time_once,
)
from qinfer.core.checkpoint import resolve_model
from qinfer.core.errors import QinferError
from qinfer.engine.generation import generate_ids
from qinfer.layers.moe import SparseMoE
from qinfer.model.transformer import Transformer
from qinfer.request.sampling import SamplingParams


@dataclass(frozen=True)
class BenchSettings:
    """What to measure: prompt length, tokens decoded per row, rows of the batched decode."""

    prompt_tokens: int = 128
    decode_tokens: int = 32
    batch_size: int = 8
    repeats: int = 3  # each figure is timed this many times; the fastest run counts
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "batch_size", "repeats"):
            if getattr(self, name) < 1:
                raise QinferError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.decode_tokens < 2:
            raise QinferError(f"decode_tokens must be at least 2, got {self.decode_tokens}")


@dataclass(frozen=True)
class EngineFigures:
    """One engine's measurements on one checkpoint."""

    engine: str
    prefill_tokens_per_second: float
    decode_tokens_per_second: float  # batch 1
    batch_decode_tokens_per_second: float  # batch_size rows, all rows' tokens
    weight_bytes_per_step: int
    weight_gb_per_second: float  # at batch 1
    peak_memory_bytes: int  # above what the process held before loading this engine


@dataclass
class Runner:
    """One engine, loaded, as the benchmark drives it.

    prefill: run a (1, P) prompt through the model (last-position logits only).
    decode_seconds: greedy-generate n tokens for each row of (B, P) prompts; return the
        seconds from the first token (which the prefill produced) to the last.
    """

    name: str
    prefill: Callable[[torch.Tensor], object]
    decode_seconds: Callable[[torch.Tensor, int], float]
    weight_bytes: int
    model: object  # the loaded model
    peak_memory_bytes: int = 0

    @property
    def device(self) -> torch.device:
        return self.model.device


def run_benchmarks(
    model_spec: str | None,
    load_args: dict | None,
    settings: BenchSettings,
    compare_hf: bool = False,
) -> dict:
    """Measure qinfer (and transformers with compare_hf) on one checkpoint; a JSON-ready dict.

    Each engine is loaded and warmed up alone (its peak memory is taken then); the timed
    runs then alternate between the engines, so that a change in the machine's load
    touches both alike. load_args: `load_model`'s keywords (dtype, device, quantize, ...).
    """
    path = resolve_model(model_spec)

    def load() -> Runner:
        _, model = load_qinfer(str(path), load_args)
        needed, limit = (
            settings.prompt_tokens + settings.decode_tokens,
            model.config.max_position_embeddings,
        )
        if needed > limit:
            raise QinferError(
                f"prompt_tokens + decode_tokens ({needed}) exceed the model's context ({limit})"
            )
        return qinfer_runner(model)

    device = bench_device(load_args)
    runners = [load_alone(load, device, settings)]
    model = runners[0].model
    report = {
        "model": str(path),
        "model_type": model.config.model_type,
        **describe_setup(model),
        "settings": asdict(settings),
    }
    if compare_hf:
        load_reference = functools.partial(transformers_runner, path, model.dtype, device)
        runners.append(load_alone(load_reference, device, settings))
    figures = measure(runners, settings, model.config.vocab_size)
    for f in figures:
        report[f.engine] = asdict(f)
    if compare_hf:
        ours, theirs = figures
        report["qinfer_over_transformers"] = {
            name: round(getattr(ours, name) / getattr(theirs, name), 3)
            for name in (
                "prefill_tokens_per_second",
                "decode_tokens_per_second",
                "batch_decode_tokens_per_second",
                "peak_memory_bytes",
            )
        }
    return report


def random_prompts(settings: BenchSettings, vocab_size: int) -> torch.Tensor:
    """(batch_size, prompt_tokens) random ids, the same for every engine of one run."""
    generator = torch.Generator().manual_seed(settings.seed)
    shape = (settings.batch_size, settings.prompt_tokens)
    return torch.randint(0, vocab_size, shape, generator=generator)


def load_alone(load: Callable[[], Runner], device: torch.device, settings: BenchSettings) -> Runner:
    """Load an engine and run each measurement once (a warm-up); its peak memory is what
    loading and running it added to what the process held before."""
    gc.collect()
    before = current_memory(device)
    reset_peak_memory(device)
    runner = load()
    warm = random_prompts(settings, 2)  # any ids: ids 0 and 1 exist in every vocabulary
    runner.prefill(warm[:1].to(device))
    runner.decode_seconds(warm.to(device), 2)
    runner.peak_memory_bytes = max(peak_memory(device) - before, 0)
    return runner


def measure(runners: list[Runner], settings: BenchSettings, vocab_size: int) -> list:
    """EngineFigures per runner: the fastest of `repeats` rounds, the engines alternating."""
    prompts = random_prompts(settings, vocab_size)
    n = settings.decode_tokens
    best: dict[str, dict[str, float]] = {r.name: {} for r in runners}
    for _ in range(settings.repeats):
        for r in runners:
            rows = prompts.to(r.device)
            times = {
                "prefill": time_once(lambda r=r, rows=rows: r.prefill(rows[:1]), r.device),
                "single": r.decode_seconds(rows[:1], n),
                "batch": r.decode_seconds(rows, n),
            }
            for key, seconds in times.items():
                best[r.name][key] = min(seconds, best[r.name].get(key, float("inf")))
    figures = []
    for r in runners:
        b = best[r.name]
        single = (n - 1) / b["single"]
        figures.append(
            EngineFigures(
                engine=r.name,
                prefill_tokens_per_second=settings.prompt_tokens / b["prefill"],
                decode_tokens_per_second=single,
                batch_decode_tokens_per_second=settings.batch_size * (n - 1) / b["batch"],
                weight_bytes_per_step=r.weight_bytes,
                weight_gb_per_second=r.weight_bytes * single / 1e9,
                peak_memory_bytes=r.peak_memory_bytes,
            )
        )
    return figures


# --- qinfer ---------------------------------------------------------------------------


def qinfer_runner(model: Transformer) -> Runner:
    """Prefill through the model, decode through `generate_ids` (sampling, stop checks)."""

    def prefill(prompt: torch.Tensor) -> None:
        model(prompt, cache=model.make_cache(1, max_length=prompt.shape[1]), last_only=True)

    def decode_seconds(rows: torch.Tensor, n: int) -> float:
        greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        results = generate_ids(model, rows.tolist(), greedy)
        return max(r.timings.decode_seconds for r in results)

    return Runner("qinfer", prefill, decode_seconds, weight_bytes_per_step(model), model)


def weight_bytes_per_step(model: Transformer) -> int:
    """Bytes of weights one decode step reads: every layer's tensors, the final norm and
    the lm_head (RoPE's frequencies are not weights; the embedding table only when tied); of a
    mixture of experts, the router and the k experts one token uses (`active_nbytes`)."""
    sizes: dict[int, int] = {}  # data_ptr -> bytes, so shared tensors count once

    def visit(module: torch.nn.Module) -> None:
        if isinstance(module, SparseMoE):
            sizes[-id(module)] = module.active_nbytes  # keyed apart from any tensor's address
            return
        for tensor in module.buffers(recurse=False):
            sizes[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        for child in module.children():
            visit(child)

    for module in (model.layers, model.norm, model.lm_head):
        visit(module)
    return sum(sizes.values())


# --- transformers -----------------------------------------------------------------------


def transformers_runner(path: Path, dtype: torch.dtype, device: torch.device) -> Runner:
    """The same checkpoint in transformers, driven through `model.generate` with EOS
    suppressed."""
    model = load_transformers_model(path, dtype, device)
    from transformers import LogitsProcessor, LogitsProcessorList

    class FirstStepClock(LogitsProcessor):
        """Notes when generate first asks for a token: the prefill forward is done."""

        started: float | None = None

        def __call__(self, input_ids, scores):
            if self.started is None:
                synchronize(device)
                self.started = time.perf_counter()
            return scores

    @torch.inference_mode()
    def prefill(prompt: torch.Tensor) -> None:
        model(prompt, logits_to_keep=1)

    @torch.inference_mode()
    def decode_seconds(rows: torch.Tensor, n: int) -> float:
        clock = FirstStepClock()
        model.generate(
            rows,
            attention_mask=torch.ones_like(rows),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([clock]),
        )
        synchronize(device)
        return time.perf_counter() - clock.started

    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not tied:  # a step reads one row of the embedding table
        embedding = model.get_input_embeddings().weight
        weight_bytes -= embedding.numel() * embedding.element_size()
    return Runner("transformers", prefill, decode_seconds, weight_bytes, model)


# --- memory -----------------------------------------------------------------------------


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: CUDA's allocator statistics, or Linux's peak RSS (VmHWM)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # elsewhere the peak covers the whole process


def current_memory(device: torch.device) -> int:
    """Bytes held now: allocated on CUDA, resident (VmRSS) on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _proc_status_bytes("VmRSS:") or 0


def peak_memory(device: torch.device) -> int:
    """Peak bytes since `reset_peak_memory`: allocated on CUDA, resident on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = _proc_status_bytes("VmHWM:")
    return peak or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def _proc_status_bytes(field: str) -> int | None:
    """A memory figure from Linux's /proc/self/status (reported in kB), None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def format_report(report: dict) -> str:
    """The report as a small table (qinfer, and transformers with its ratio when measured)."""
    s = report["settings"]
    rows = [
        (f"prefill tok/s ({s['prompt_tokens']} tokens)", "prefill_tokens_per_second", 1.0),
        ("decode tok/s (batch 1)", "decode_tokens_per_second", 1.0),
        (f"decode tok/s (batch {s['batch_size']})", "batch_decode_tokens_per_second", 1.0),
        ("weight GB/s (batch 1)", "weight_gb_per_second", 1.0),
        ("weights read per step (MB)", "weight_bytes_per_step", 1e-6),
        ("peak memory (MB)", "peak_memory_bytes", 1e-6),
    ]
    engines = [e for e in ("qinfer", "transformers") if e in report]
    header = f"{'':32}" + "".join(f"{e:>14}" for e in engines)
    if len(engines) == 2:
        header += f"{'ratio':>10}"
    lines = [
        f"{report['model']} ({report['model_type']}), {s['decode_tokens']} tokens decoded per row",
        format_setup(report),
        header,
    ]
    for label, key, scale in rows:
        values = [report[e][key] for e in engines]
        line = f"{label:32}" + "".join(f"{v * scale:14.1f}" for v in values)
        if len(values) == 2 and values[1]:
            line += f"{values[0] / values[1]:10.2f}"
        lines.append(line)
    return "\n".join(lines)

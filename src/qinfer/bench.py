"""How fast one checkpoint runs: prefill and decode speed, peak memory, weight bandwidth.

    qinfer bench --model M [--prompt-tokens 128] [--decode-tokens 32] [--batch-size 8]
                 [--compare-hf] [--json]

- prefill tok/s: one forward over a random prompt of `prompt_tokens` ids (last-position
  logits only, as generation does).
- decode tok/s: greedy generation of `decode_tokens` tokens after that prompt through
  `qinfer.generate` (sampling, stop checks and all), at batch 1 and at `batch_size` rows
  (for the batch, tokens of all rows per second). The first token, which the prefill
  produced, is not counted.
- every figure is the fastest of `repeats` runs, after a warm-up.
- weight GB/s: decode at batch 1 reads every weight once per token, so it is bound by
  memory bandwidth: bytes of weights read per step x steps per second, to set against
  the machine's bandwidth. The embedding table is not counted (a step reads one row of
  it) unless it doubles as the lm_head.
- peak memory: the process's peak RSS on CPU (reset before loading when Linux allows),
  `torch.cuda.max_memory_allocated` on CUDA.

`--compare-hf` measures `transformers` on the same checkpoint (an HF folder, or a GGUF
file through transformers' GGUF loading, which dequantizes it) in the same process, after
qinfer's model is freed, and reports qinfer / transformers ratios: on a shared machine
absolute times are noise, ratios from one run are evidence.
"""

from __future__ import annotations

import gc
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from qinfer.checkpoint import resolve_model
from qinfer.errors import QinferError
from qinfer.generate import generate_ids
from qinfer.layers.rope import RoPE
from qinfer.model import Transformer, default_device, load_model
from qinfer.sampling import SamplingParams


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
    peak_memory_bytes: int


def run_benchmarks(
    model_spec: str | None,
    dtype: str | None,
    device: str | None,
    settings: BenchSettings,
    compare_hf: bool = False,
) -> dict:
    """Measure qinfer (and transformers with compare_hf) on one checkpoint; a JSON-ready dict."""
    path = resolve_model(model_spec)
    device = torch.device(device) if device is not None else default_device()
    reset_peak_memory(device)
    model = load_model(path, dtype=dtype, device=device)
    if settings.prompt_tokens + settings.decode_tokens > model.config.max_position_embeddings:
        raise QinferError(
            f"prompt_tokens + decode_tokens ({settings.prompt_tokens + settings.decode_tokens}) "
            f"exceed the model's context ({model.config.max_position_embeddings})"
        )
    report = {
        "model": str(path),
        "model_type": model.config.model_type,
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "settings": asdict(settings),
    }
    prompts = random_prompts(settings, model.config.vocab_size)
    qinfer_figures = bench_qinfer(model, prompts, settings)
    report["qinfer"] = asdict(qinfer_figures)
    if compare_hf:
        model_dtype = model.dtype
        del model
        gc.collect()
        reset_peak_memory(device)
        reference = load_transformers(path, model_dtype, device)
        hf_figures = bench_transformers(reference, prompts, settings)
        report["transformers"] = asdict(hf_figures)
        report["qinfer_over_transformers"] = {
            name: round(getattr(qinfer_figures, name) / getattr(hf_figures, name), 3)
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


# --- qinfer ---------------------------------------------------------------------------


def bench_qinfer(model: Transformer, prompts: torch.Tensor, settings: BenchSettings):
    """EngineFigures of a loaded qinfer model; prompts (batch_size, prompt_tokens)."""
    first = prompts[:1].to(model.device)  # (1, prompt_tokens)

    def prefill() -> None:
        cache = model.make_cache(1, max_length=first.shape[1])
        model(first, cache=cache, last_only=True)

    greedy = SamplingParams(temperature=0.0, max_tokens=settings.decode_tokens, ignore_eos=True)

    def decode_tokens_per_second(rows: torch.Tensor) -> float:
        """The best of `repeats` runs; decode time excludes the prefill's first token."""
        seconds = min(
            max(r.timings.decode_seconds for r in generate_ids(model, rows.tolist(), greedy))
            for _ in range(settings.repeats)
        )
        return rows.shape[0] * (settings.decode_tokens - 1) / seconds

    generate_ids(model, prompts[:1, :8].tolist(), greedy.replace(max_tokens=2))  # warm-up
    prefill_seconds = best_time(prefill, settings.repeats, model.device)
    single = decode_tokens_per_second(prompts[:1])
    weight_bytes = weight_bytes_per_step(model)
    return EngineFigures(
        engine="qinfer",
        prefill_tokens_per_second=settings.prompt_tokens / prefill_seconds,
        decode_tokens_per_second=single,
        batch_decode_tokens_per_second=decode_tokens_per_second(prompts),
        weight_bytes_per_step=weight_bytes,
        weight_gb_per_second=weight_bytes * single / 1e9,
        peak_memory_bytes=peak_memory(model.device),
    )


def weight_bytes_per_step(model: Transformer) -> int:
    """Bytes of weights one decode step reads: every layer's tensors, the final norm and
    the lm_head (RoPE tables are not weights; the embedding table only when tied)."""
    sizes: dict[int, int] = {}  # data_ptr -> bytes, so shared tensors count once
    visited: set[int] = set()

    def visit(obj) -> None:
        if id(obj) in visited or isinstance(obj, RoPE):
            return
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            sizes[obj.data_ptr()] = obj.numel() * obj.element_size()
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item)
        elif hasattr(obj, "__dict__"):
            for value in vars(obj).values():
                visit(value)

    visit([model.layers, model.norm, model.lm_head])
    return sum(sizes.values())


# --- transformers -----------------------------------------------------------------------


def load_transformers(path: Path, dtype: torch.dtype, device: torch.device):
    """The same checkpoint as a transformers model (GGUF through its gguf_file loader)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise QinferError("--compare-hf needs transformers: pip install transformers") from None
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def bench_transformers(model, prompts: torch.Tensor, settings: BenchSettings) -> EngineFigures:
    """EngineFigures of a transformers model, measured like `bench_qinfer`: decode time is
    generate(n tokens) - generate(1 token), both greedy with EOS suppressed."""
    device = model.device
    prompts = prompts.to(device)

    def run_generate(rows: torch.Tensor, new_tokens: int) -> None:
        model.generate(
            rows,
            attention_mask=torch.ones_like(rows),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )

    def decode_tokens_per_second(rows: torch.Tensor) -> float:
        n, repeats = settings.decode_tokens, settings.repeats
        with_prefill = min(time_once(lambda: run_generate(rows, n), device) for _ in range(repeats))
        prefill_only = min(time_once(lambda: run_generate(rows, 1), device) for _ in range(repeats))
        return rows.shape[0] * (n - 1) / (with_prefill - prefill_only)

    with torch.inference_mode():
        run_generate(prompts[:1, :8], 2)  # warm-up
        prefill_seconds = best_time(
            lambda: model(prompts[:1], logits_to_keep=1), settings.repeats, device
        )
        single = decode_tokens_per_second(prompts[:1])
        batch = decode_tokens_per_second(prompts)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not tied:
        embedding = model.get_input_embeddings().weight
        weight_bytes -= embedding.numel() * embedding.element_size()
    return EngineFigures(
        engine="transformers",
        prefill_tokens_per_second=settings.prompt_tokens / prefill_seconds,
        decode_tokens_per_second=single,
        batch_decode_tokens_per_second=batch,
        weight_bytes_per_step=weight_bytes,
        weight_gb_per_second=weight_bytes * single / 1e9,
        peak_memory_bytes=peak_memory(device),
    )


# --- timing and memory ------------------------------------------------------------------


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds fn takes, waiting for the device to finish."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def best_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """The fastest of `repeats` runs (after one untimed warm-up run)."""
    time_once(fn, device)
    return min(time_once(fn, device) for _ in range(repeats))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: CUDA's allocator statistics, or Linux's peak RSS (VmHWM)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # elsewhere the peak covers the whole process


def peak_memory(device: torch.device) -> int:
    """Peak bytes since `reset_peak_memory`: allocated on CUDA, resident on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


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
        f"{report['model']} ({report['model_type']}), {report['dtype']} on {report['device']}, "
        f"{report['threads']} threads, {s['decode_tokens']} tokens decoded per row",
        header,
    ]
    for label, key, scale in rows:
        values = [report[e][key] for e in engines]
        line = f"{label:32}" + "".join(f"{v * scale:14.1f}" for v in values)
        if len(values) == 2 and values[1]:
            line += f"{values[0] / values[1]:10.2f}"
        lines.append(line)
    return "\n".join(lines)

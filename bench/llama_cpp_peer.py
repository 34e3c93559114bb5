"""qinfer against llama.cpp on the same GGUF checkpoint, on the CPU, in one run.

    python bench/llama_cpp_peer.py                      # the embedded SmolLM2-135M Q4_1
    python bench/llama_cpp_peer.py --model M.gguf --threads 4 --repeats 5 --json

llama.cpp runs through llama-cpp-python's low-level C API (`pip install 'qinfer[peer]'`);
both engines get the same random prompt token ids and the same number of threads.

- prefill tok/s: one forward over a 512-token prompt (logits of its last token only).
- decode tok/s, batch 1: greedy decoding of 64 tokens after that prompt. The first token
  comes from the prefill and is not counted: tokens after it / seconds after it.
- decode tok/s, batch 8: the same for 8 sequences of 128-token prompts decoding together
  (tokens of all sequences). qinfer: `generate_ids`; llama.cpp: one `llama_decode` per
  step with the 8 sequences' tokens, each under its own sequence id.
- engine tok/s: qinfer's batching engine (`qinfer.LLM`) on 32 such prompts, all output
  tokens / wall seconds, prefill included; set against llama.cpp's batch-8 decode.
- weight GB/s (batch 1): the bytes of weights one decode step reads (qinfer: its layers,
  final norm and head as loaded, `weight_bytes_per_step`; llama.cpp: the file's tensors but
  the embedding table, unless it is also the head) x batch-1 decode steps per second, beside
  the machine's read bandwidth measured here (`read_bandwidth_gb_s`: the best of a few sums
  over a 1 GiB buffer with the same threads), the ceiling both approach.
- peak memory: each engine in a fresh process of its own (multiprocessing, spawn) loads
  the model and runs the prefill and the two decodes once (not the batching engine); its
  peak RSS (VmHWM) is the whole process's, interpreter and libraries included.

Speeds are the best of `--repeats` rounds that alternate between the engines, after a
warm-up, so that a change in the machine's load touches both alike; each round draws
fresh prompts, so qinfer's prefix cache never serves a prompt it has seen. Ratios are
qinfer / llama.cpp: above 1, qinfer is faster (or, for memory, larger).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

# qinfer (with torch) and llama_cpp are imported inside the engine classes, so that the
# process measuring one engine's memory loads that engine's libraries only.

SKIP_MESSAGE = (
    "skipped: llama-cpp-python is an optional extra (pip install 'qinfer[peer]'); "
    "it builds llama.cpp from source, about 6 minutes on 2 cores"
)


@dataclass(frozen=True)
class Settings:
    model: str  # a .gguf file
    threads: int = 2
    prefill_tokens: int = 512
    decode_tokens: int = 64
    batch_size: int = 8
    batch_prompt_tokens: int = 128
    engine_seqs: int = 32
    repeats: int = 3
    seed: int = 0
    prefill_only: bool = False  # the prefill alone (no decodes, engine, memory)
    load_kwargs: dict = field(
        default_factory=dict
    )  # dtype= / quantize= / kv_cache_dtype= / exact= for load_model
    # llama.cpp's extra buffer types (its weights repacked for AMX / AVX-512 tiles); off
    # with --no-repack: 0.3.36 built for an AMX Xeon crashes with them on qwen35 files
    llama_extra_bufts: bool = True


class Qinfer:
    """qinfer on the CPU: the model's forward, `generate_ids`, and the batching engine."""

    name = "qinfer"

    def __init__(self, s: Settings) -> None:
        import torch

        from qinfer import load_model

        torch.set_num_threads(s.threads)
        self.model = load_model(s.model, device="cpu", **s.load_kwargs)
        self.vocab_size = self.model.config.vocab_size

    @cached_property
    def engine(self):
        from qinfer import LLM

        return LLM(self.model)  # the loaded model, the engine's default settings

    def prefill_seconds(self, ids: list[int]) -> float:
        import torch

        tokens = torch.tensor([ids])
        start = time.perf_counter()
        self.model(tokens, cache=self.model.make_cache(1, max_length=len(ids)), last_only=True)
        return time.perf_counter() - start

    def decode_seconds(self, rows: list[list[int]], n: int) -> float:
        """Seconds from the first greedy token of the rows (decoding together) to the last."""
        from qinfer.engine.generation import generate_ids

        results = generate_ids(self.model, rows, greedy(n))
        return max(r.timings.decode_seconds for r in results)

    def engine_seconds(self, rows: list[list[int]], n: int) -> float:
        start = time.perf_counter()
        outputs = self.engine.generate(rows, greedy(n), use_tqdm=False)
        assert all(len(o.token_ids) == n for o in outputs)
        return time.perf_counter() - start


def greedy(n: int):
    """qinfer's sampling settings for exactly n greedy tokens."""
    from qinfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


class LlamaCpp:
    """llama.cpp through llama-cpp-python's C API: one context, one reusable batch."""

    name = "llama.cpp"

    def __init__(self, s: Settings) -> None:
        import llama_cpp

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its load chatter
        self.lib = llama = llama_cpp
        llama.llama_backend_init()
        model_params = llama.llama_model_default_params()
        model_params.use_extra_bufts = s.llama_extra_bufts
        self.model = llama.llama_model_load_from_file(s.model.encode(), model_params)
        seq_len = max(s.prefill_tokens, s.batch_prompt_tokens) + s.decode_tokens
        batch_tokens = max(s.prefill_tokens, s.batch_size * s.batch_prompt_tokens)
        params = llama.llama_context_default_params()
        params.n_seq_max = s.batch_size
        # The KV cache is split evenly among the sequences, each share padded to 256 cells.
        params.n_ctx = s.batch_size * -(-seq_len // 256) * 256
        params.n_batch = batch_tokens  # the most tokens one llama_decode call may take
        params.n_threads = params.n_threads_batch = s.threads
        self.ctx = llama.llama_init_from_model(self.model, params) if self.model else None
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not load {s.model}")
        self.batch = llama.llama_batch_init(batch_tokens, 0, 1)  # one sequence id per token
        self.vocab_size = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self.model))

    def _fill(self, rows: list[tuple[int, int, list[int]]]) -> list[int]:
        """Put rows of (sequence id, first position, token ids) into the batch, asking for
        logits at each row's last token; the batch indices of those tokens."""
        b, i, last = self.batch, 0, []
        for seq, start, ids in rows:
            for offset, token in enumerate(ids):
                b.token[i], b.pos[i], b.n_seq_id[i] = token, start + offset, 1
                b.seq_id[i][0] = seq
                b.logits[i] = offset == len(ids) - 1
                i += 1
            last.append(i - 1)
        b.n_tokens = i
        return last

    def _run(self, last: list[int]) -> list[int]:
        """llama_decode the batch; the greedy next token at each index of `last`."""
        if (status := self.lib.llama_decode(self.ctx, self.batch)) != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        logits = (self.lib.llama_get_logits_ith(self.ctx, i) for i in last)
        return [int(np.ctypeslib.as_array(p, (self.vocab_size,)).argmax()) for p in logits]

    def _clear(self) -> None:
        """Forget every sequence (llama_memory_clear was llama_kv_self_clear before)."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def prefill_seconds(self, ids: list[int]) -> float:
        self._clear()
        last = self._fill([(0, 0, ids)])
        start = time.perf_counter()
        self._run(last)
        return time.perf_counter() - start

    def decode_seconds(self, rows: list[list[int]], n: int) -> float:
        """Seconds from the first greedy token of the rows (decoding together) to the last."""
        self._clear()
        tokens = self._run(self._fill([(seq, 0, ids) for seq, ids in enumerate(rows)]))
        start = time.perf_counter()
        for step in range(n - 1):
            pairs = enumerate(zip(rows, tokens, strict=True))
            tokens = self._run(self._fill([(seq, len(ids) + step, [t]) for seq, (ids, t) in pairs]))
        return time.perf_counter() - start


def draw_prompts(s: Settings, vocab_size: int, seed: int) -> tuple[list[int], list[list[int]]]:
    """Random ids: one long prompt, and max(batch_size, engine_seqs) short ones."""
    rng = random.Random(seed)
    long = [rng.randrange(vocab_size) for _ in range(s.prefill_tokens)]
    rows = max(s.batch_size, s.engine_seqs)
    short = [[rng.randrange(vocab_size) for _ in range(s.batch_prompt_tokens)] for _ in range(rows)]
    return long, short


def measure(engine: Qinfer | LlamaCpp, s: Settings, seed: int, n: int, batching: bool) -> dict:
    """Tokens/s of each measurement on fresh prompts; with `batching`, qinfer's engine too."""
    long, rows = draw_prompts(s, engine.vocab_size, seed)
    if s.prefill_only:
        return {"prefill_tok_s": s.prefill_tokens / engine.prefill_seconds(long)}
    b = s.batch_size
    figures = {
        "prefill_tok_s": s.prefill_tokens / engine.prefill_seconds(long),
        "decode_b1_tok_s": (n - 1) / engine.decode_seconds([long], n),
        "decode_batch_tok_s": b * (n - 1) / engine.decode_seconds(rows[:b], n),
    }
    if batching and isinstance(engine, Qinfer):
        seqs = s.engine_seqs
        figures["engine_tok_s"] = seqs * n / engine.engine_seconds(rows[:seqs], n)
    return figures


def gguf_bytes_per_token(path: str) -> int:
    """Bytes of the file's tensors a llama.cpp decode step reads: all but the embedding table,
    of which a step reads one row, unless the model has no output.weight (a tied head)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def read_bandwidth_gb_s(threads: int, gib: int = 1) -> float:
    """The machine's read bandwidth with `threads` threads: the best of 5 sums over a buffer
    of `gib` GiB (fp32; far larger than any cache), in GB/s."""
    import torch

    torch.set_num_threads(threads)
    buffer = torch.ones(gib << 28)  # 4 bytes each
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best / 1e9


def peak_memory_mb(engine_class: type[Qinfer | LlamaCpp], s: Settings) -> float:
    """In a fresh process: load one engine, run the measurements once; its VmHWM in MB."""
    measure(engine_class(s), s, s.seed, s.decode_tokens, batching=False)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status (not Linux?)")


def run(s: Settings) -> dict:
    """Measure both engines on one checkpoint; a JSON-ready report."""
    engines = [Qinfer(s), LlamaCpp(s)]
    for engine in engines:  # warm-up, on prompts no timed round uses
        measure(engine, s, s.seed + s.repeats, 2, batching=True)
    best: dict[str, dict[str, float]] = {e.name: {} for e in engines}
    for r in range(s.repeats):
        for engine in engines:
            figures = measure(engine, s, s.seed + r, s.decode_tokens, batching=True)
            for key, value in figures.items():
                best[engine.name][key] = max(value, best[engine.name].get(key, 0.0))
    if not s.prefill_only:
        spawn = multiprocessing.get_context("spawn")
        for engine in engines:  # each engine's memory, alone in a fresh process
            with ProcessPoolExecutor(1, mp_context=spawn) as process:
                peak = process.submit(peak_memory_mb, type(engine), s).result()
            best[engine.name]["peak_memory_mb"] = peak
        from qinfer.bench.model import weight_bytes_per_step

        step_bytes = {
            "qinfer": weight_bytes_per_step(engines[0].model),
            "llama.cpp": gguf_bytes_per_token(s.model),
        }
        for name, nbytes in step_bytes.items():
            best[name]["weight_mb_per_step"] = nbytes / 1e6
            best[name]["weight_gb_s"] = nbytes * best[name]["decode_b1_tok_s"] / 1e9
    settings = {k: v for k, v in asdict(s).items() if k != "model"}
    return {
        "model": s.model,
        "read_bandwidth_gb_s": read_bandwidth_gb_s(s.threads),
        "gguf_mb": Path(s.model).stat().st_size / 2**20,
        "qinfer_dtype": str(engines[0].model.dtype).removeprefix("torch."),
        "settings": settings,
        **best,
        "qinfer_over_llama_cpp": {
            ours: best["qinfer"][ours] / best["llama.cpp"][theirs]
            for _, ours, theirs in table_rows(settings)
        },
    }


def table_rows(s: dict) -> list[tuple[str, str, str]]:
    """(label, qinfer's figure, the llama.cpp figure it is set against), per table row."""
    b = s["batch_size"]
    prefill = (f"prefill tok/s ({s['prefill_tokens']} tokens)", "prefill_tok_s", "prefill_tok_s")
    if s.get("prefill_only"):
        return [prefill]
    return [
        prefill,
        ("decode tok/s (batch 1)", "decode_b1_tok_s", "decode_b1_tok_s"),
        (f"decode tok/s (batch {b})", "decode_batch_tok_s", "decode_batch_tok_s"),
        (
            f"engine tok/s ({s['engine_seqs']} seqs) / batch {b}",
            "engine_tok_s",
            "decode_batch_tok_s",
        ),
        ("weights read per step (MB)", "weight_mb_per_step", "weight_mb_per_step"),
        ("weight GB/s (batch 1)", "weight_gb_s", "weight_gb_s"),
        ("peak memory MB (lower is better)", "peak_memory_mb", "peak_memory_mb"),
    ]


def format_report(report: dict) -> str:
    s = report["settings"]
    ours, theirs = report["qinfer"], report["llama.cpp"]
    lines = [
        f"{report['model']} ({report['gguf_mb']:.1f} MB; qinfer in {report['qinfer_dtype']}), "
        f"{s['threads']} threads, {s['decode_tokens']} tokens per sequence, best of {s['repeats']}"
        + ("" if s["llama_extra_bufts"] else "; llama.cpp without repacked weights"),
        f"{'':38}{'qinfer':>10}{'llama.cpp':>11}{'qinfer/llama.cpp':>18}",
    ]
    for label, key, their_key in table_rows(s):
        ratio = report["qinfer_over_llama_cpp"][key]
        lines.append(f"{label:38}{ours[key]:10.1f}{theirs[their_key]:11.1f}{ratio:18.2f}")
    lines.append(
        f"machine read bandwidth, {s['threads']} threads: {report['read_bandwidth_gb_s']:.1f} GB/s"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default SmolLM2 Q4_1)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for both engines")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; the best counts")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--dtype", default=None, help="passed to qinfer.load_model if given")
    parser.add_argument("--quantize", default=None, help="passed to qinfer.load_model if given")
    parser.add_argument(
        "--kv-cache-dtype", default=None, help="qinfer's KV storage (llama.cpp keeps f16)"
    )
    parser.add_argument(
        "--exact", action="store_true", help="qinfer's reference mode (fp32 activations)"
    )
    parser.add_argument(
        "--prefill-only", action="store_true", help="time the 512-token prefill alone"
    )
    parser.add_argument(
        "--no-repack",
        action="store_true",
        help="llama.cpp without its repacked weights (use_extra_bufts off: they crash "
        "llama.cpp 0.3.36 on Qwen3.5 files on an AMX Xeon)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print(SKIP_MESSAGE)
        return
    from qinfer.core.checkpoint import resolve_model

    path = resolve_model(args.model)
    if path.suffix != ".gguf":
        parser.error(f"{path} is not a .gguf file; llama.cpp reads GGUF only")
    if args.decode_tokens < 2:
        parser.error("--decode-tokens must be at least 2 (the first comes from the prefill)")
    given = {"dtype": args.dtype, "quantize": args.quantize, "kv_cache_dtype": args.kv_cache_dtype}
    given["exact"] = args.exact or None
    settings = Settings(
        str(path),
        threads=args.threads,
        decode_tokens=args.decode_tokens,
        repeats=args.repeats,
        prefill_only=args.prefill_only,
        load_kwargs={k: v for k, v in given.items() if v is not None},
        llama_extra_bufts=not args.no_repack,
    )
    report = run(settings) | {"llama_cpp_python": llama_cpp.__version__}
    print(json.dumps(report, indent=2) if args.json else format_report(report))


if __name__ == "__main__":
    main()

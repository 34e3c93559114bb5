"""Two qinfer source trees against each other, measured at the same moments: a speed gate
that survives a noisy machine.

    python bench/paired_ab.py BEFORE_SRC AFTER_SRC [--pairs 2] [--rounds 4] [--turns] [--json]
    # e.g. git worktree add --detach ../before 5c3a668
    #      python bench/paired_ab.py ../before/src src

On a shared host the speed of one process drifts by 10-30% between minutes, more than
the 5% such a gate allows, so measuring "before" and "after" in alternating processes
cannot resolve it. Here both trees are loaded at once, in two processes, and each timed
run is set against its twin, taken at the same moment or the moment next to it:

- lockstep (default): both run at the same time, one thread each, each pinned to its own
  core (`os.sched_setaffinity`; the cores swap between pairs), and a file barrier starts
  every timed run in both together: a slow moment slows both.
- `--turns`: they take turns on every core, with the default threads, run by run
  (before, after, before, ...; the first of each pair alternates): the configuration
  users run, each run a few seconds from its twin. A drift slower than a run cancels.

The report gives, per workload, the after/before ratios and their median and geometric
mean. The workloads are `bench/llama_cpp_peer.py`'s, smaller: prefill of 512 random ids
(the model's forward), greedy decode of 48 tokens at batch 1 (512-token prompt) and batch
8 (128-token prompts), and `LLM.generate` of 32 x 128-token prompts x 64 tokens. Needs two
cores.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOADS = ("prefill", "decode_b1", "decode_b8", "engine")
SIDES = ("before", "after")


def _spread(values: list[float]) -> dict[str, float]:
    """min, median and max of a side's tok/s."""
    return {
        "min": round(min(values), 1),
        "median": round(statistics.median(values), 1),
        "max": round(max(values), 1),
    }


def _first(name: str, *modules: str):
    """`name` from the first of `modules` that this tree has."""
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except ModuleNotFoundError:
            continue
    raise ImportError(f"{name} not found in any of {', '.join(modules)}")


def worker(
    side: str, other: str, sync_dir: Path, rounds: int, turns: bool
) -> dict[str, list[float]]:
    """One tree's timings (tok/s per timed run), each run taken with its twin in the
    `other` side's process: at the same moment (lockstep), or just before or after it
    (`turns`)."""
    import torch

    from qinfer import LLM, SamplingParams, load_model

    # where older trees keep them: before the layer packages (3303565), before the one
    # engine (5c3a668)
    resolve_model = _first("resolve_model", "qinfer.core.checkpoint", "qinfer.checkpoint")
    generate_ids = _first(
        "generate_ids", "qinfer.engine.generation", "qinfer.generation", "qinfer.generate"
    )

    if not turns:
        torch.set_num_threads(1)
    model = load_model(resolve_model(None), device="cpu")
    llm = LLM(model)
    rng = random.Random(0)
    count = 0

    def ids(n: int) -> list[int]:
        return [rng.randrange(model.config.vocab_size) for _ in range(n)]

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def wait_for(name: str) -> None:
        while not (sync_dir / name).exists():
            time.sleep(0.002)

    def timed(run, *inputs) -> float:
        """run(*inputs) -> tok/s, started together with the other side's twin (lockstep),
        or in turn: "before" runs first in odd pairs, "after" in even ones."""
        nonlocal count
        count += 1
        if not turns:  # a barrier: both sides start now
            (sync_dir / f"{side}_{count}").touch()
            wait_for(f"{other}_{count}")
            return run(*inputs)
        first = "before" if count % 2 else "after"
        if side != first:
            wait_for(f"{other}_{count}")
        value = run(*inputs)
        (sync_dir / f"{side}_{count}").touch()
        if side == first:  # the twin runs now: wait, so that the next run starts clean
            wait_for(f"{other}_{count}")
        return value

    def prefill(tokens: torch.Tensor) -> float:
        start = time.perf_counter()
        model(tokens, cache=model.make_cache(1, max_length=tokens.shape[1]), last_only=True)
        return tokens.shape[1] / (time.perf_counter() - start)

    def decode(rows: list[list[int]], n: int) -> float:
        results = generate_ids(model, rows, greedy(n))
        return len(rows) * (n - 1) / max(r.timings.decode_seconds for r in results)

    def engine(rows: list[list[int]], n: int) -> float:
        start = time.perf_counter()
        llm.generate(rows, greedy(n), use_tqdm=False)
        return len(rows) * n / (time.perf_counter() - start)

    runs = {
        "prefill": lambda: timed(prefill, torch.tensor([ids(512)])),
        "decode_b1": lambda: timed(decode, [ids(512)], 48),
        "decode_b8": lambda: timed(decode, [ids(128) for _ in range(8)], 48),
        "engine": lambda: timed(engine, [ids(128) for _ in range(32)], 64),
    }
    for run in runs.values():  # warm-up, synchronised too
        run()
    out: dict[str, list[float]] = {name: [] for name in WORKLOADS}
    for _ in range(rounds):
        for name, run in runs.items():
            out[name].append(run())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="the 'before' tree's src folder")
    parser.add_argument("after", type=Path, help="the 'after' tree's src folder")
    parser.add_argument("--pairs", type=int, default=2, help="process pairs (cores swap)")
    parser.add_argument("--rounds", type=int, default=4, help="timed runs per workload")
    parser.add_argument(
        "--turns", action="store_true", help="take turns on every core instead of lockstep"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        side, other, sync_dir, out = args.worker
        timings = worker(side, other, Path(sync_dir), args.rounds, args.turns)
        Path(out).write_text(json.dumps(timings))
        return
    if len(os.sched_getaffinity(0)) < 2:
        parser.error("needs two cores: the two trees run side by side, or take turns on both")
    core_a, core_b = sorted(os.sched_getaffinity(0))[:2]
    ratios: dict[str, list[float]] = {name: [] for name in WORKLOADS}
    speeds: dict[str, dict[str, list[float]]] = {side: {n: [] for n in WORKLOADS} for side in SIDES}
    for pair in range(args.pairs):
        cores = (  # lockstep's
            {"before": core_a, "after": core_b}
            if pair % 2 == 0
            else {"before": core_b, "after": core_a}
        )
        with tempfile.TemporaryDirectory() as sync_dir:
            procs, outs = [], {}
            for side, other in zip(SIDES, reversed(SIDES), strict=True):
                outs[side] = Path(sync_dir) / f"{side}.json"
                src = getattr(args, side).resolve()
                env = {**os.environ, "PYTHONPATH": str(src)}
                command = [sys.executable, __file__, str(args.before), str(args.after)]
                command += ["--rounds", str(args.rounds), "--worker", side, other]
                command += [sync_dir, str(outs[side])] + ["--turns"] * args.turns
                process = subprocess.Popen(command, env=env)
                if not args.turns:
                    os.sched_setaffinity(process.pid, {cores[side]})
                procs.append(process)
            if any(process.wait() != 0 for process in procs):
                sys.exit("a worker failed (see its traceback above)")
            before, after = (json.loads(outs[side].read_text()) for side in SIDES)
        for name in WORKLOADS:
            ratios[name] += [a / b for a, b in zip(after[name], before[name], strict=True)]
            speeds["before"][name] += before[name]
            speeds["after"][name] += after[name]
    report = {
        name: {
            "after_over_before": [round(r, 3) for r in values],
            "median": round(statistics.median(values), 3),
            "geomean": round(statistics.geometric_mean(values), 3),
            # each side's own tok/s: how far the host's noise moved them
            **{f"{side}_tok_s": _spread(speeds[side][name]) for side in SIDES},
        }
        for name, values in ratios.items()
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for name, row in report.items():
        print(f"{name:>10}: after/before median {row['median']:.3f}, geomean {row['geomean']:.3f}")


if __name__ == "__main__":
    main()

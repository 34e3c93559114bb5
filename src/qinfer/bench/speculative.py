"""Speculative decoding's speed on one model: decode tok/s with and without it.

    qinfer bench --speculative-method ngram [--num-speculative-tokens K] [--model M]
    qinfer bench --speculative-model DRAFT [--dtype float32]      # a draft model
    python bench/speculative.py      # also llama.cpp's prompt lookup, self-drafting, 8 at once

Two workloads, greedy, the chat template applied, one request at a time:
- edit: answers that mostly copy their ~256-token prompt ("fix the typos in this
  paragraph", "add type hints to these functions");
- chat: questions with nothing to copy (speculation must not slow them down).

Decode tok/s of a request: (tokens - 1) / seconds from its first token to its last. Each
figure is the best of `repeats` rounds alternating between speculation off and on.
"""

from __future__ import annotations

import time

from qinfer.core.checkpoint import resolve_model
from qinfer.engine.llm import LLM
from qinfer.request.sampling import SamplingParams
from qinfer.text.tokenizer import Tokenizer

TYPOS = (
    "The quick brown fox jumpd over the lazy dog, and then it ran acros the feild to find its "
    "freinds who were waiting by the rivver. They had planed a big picnic with sandwiches, "
    "apples and lemonade, but the wether turned bad and it started to rain hevily. Everyone "
    "ran under a large oak tree and waited for the storm to pass. When the sun came out "
    "agian, they laughed, dried there clothes and finished the picnic on the wet grass, "
    "telling storys until the evening. The next morning the fox woke up erly, streched its "
    "legs and decided to explore the forrest behind the hill, where nobody had ever been "
    "befor. It found a small cottage with a red door and a garden full of flowers."
)
FUNCTION = '''def merge_intervals(intervals, min_gap=0):
    """Merge overlapping intervals, and those closer than min_gap."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1] + min_gap:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]


def total_length(intervals, min_gap=0):
    """The length covered by the merged intervals."""
    return sum(end - start for start, end in merge_intervals(intervals, min_gap))


def find_gaps(intervals, lower, upper):
    """The parts of [lower, upper] that no interval covers."""
    gaps, cursor = [], lower
    for start, end in merge_intervals(intervals):
        if start > cursor:
            gaps.append((cursor, min(start, upper)))
        cursor = max(cursor, end)
    if cursor < upper:
        gaps.append((cursor, upper))
    return gaps
'''
EDIT = [
    "Fix the typos in this paragraph. Write out the whole corrected paragraph.\n\n" + TYPOS,
    "Add type hints to these functions. Write out the whole code.\n\n" + FUNCTION,
]
CHAT = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a rainbow forms, step by step.",
]


def chat_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """A one-turn conversation's prompt ids."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def decode_rate(llm: LLM, ids: list[int], max_tokens: int) -> tuple[float, int]:
    """(decode tok/s, tokens) of one greedy request alone in the engine."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engine.add_request(ids, params)
    first = last = None
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            if out.token_ids and first is None:
                first = now
            last, tokens = now, len(out.token_ids)
    return (tokens - 1) / (last - first), tokens


def best_of(repeats: int, runs: dict) -> dict:
    """Alternate the named runs `repeats` times; each one's best (rate, tokens) pair (a run
    returning a bare rate gets tokens None)."""
    best: dict = {}
    for _ in range(repeats):
        for name, run in runs.items():
            result = run()
            result = result if isinstance(result, tuple) else (result, None)
            if name not in best or result[0] > best[name][0]:
                best[name] = result
    return best


def workload_ids(tokenizer: Tokenizer) -> dict[str, list[list[int]]]:
    """The prompt ids of each workload."""
    return {
        "edit": [chat_ids(tokenizer, text) for text in EDIT],
        "chat": [chat_ids(tokenizer, text) for text in CHAT],
    }


def run_speculative_benchmark(
    model_spec: str | None,
    load_args: dict,
    speculative: dict,
    repeats: int = 3,
    max_tokens: int = 192,
) -> dict:
    """Decode tok/s of each workload's prompts with speculation off and on (`speculative`:
    the engine's settings), the speed-up of each workload (sum of on / sum of off), and the
    acceptance rate and mean accepted length with it on."""
    path = resolve_model(model_spec)
    plain = LLM(path, **load_args)
    spec = LLM(path, speculative=speculative, **load_args)
    shown = {key: str(value) for key, value in speculative.items()}  # a draft path as text
    report: dict = {"model": str(path), "speculative": shown}
    for name, prompts in workload_ids(plain.engine.tokenizer).items():
        runs = {}
        for i, ids in enumerate(prompts):
            runs[f"off/{i}"] = lambda ids=ids: decode_rate(plain, ids, max_tokens)
            runs[f"on/{i}"] = lambda ids=ids: decode_rate(spec, ids, max_tokens)
        rates = best_of(repeats, runs)
        off = sum(rate for key, (rate, _) in rates.items() if key.startswith("off"))
        on = sum(rate for key, (rate, _) in rates.items() if key.startswith("on"))
        report[name] = {"decode_tok_s": rates, "speedup": on / off}
    stats = spec.engine.stats()
    report["acceptance_rate"] = stats.spec_acceptance_rate
    report["mean_accepted_length"] = stats.spec_mean_accepted_length
    return report


def format_speculative_report(report: dict) -> str:
    """The report as a few lines: each workload's rates and speed-up, then acceptance."""
    lines = [report["model"], f"speculative: {report['speculative']}"]
    for name in ("edit", "chat"):
        section = report[name]
        rates = ", ".join(
            f"{key} {rate:.1f} ({tokens} tok)"
            for key, (rate, tokens) in section["decode_tok_s"].items()
        )
        lines.append(f"{name}: speed-up {section['speedup']:.2f}x; decode tok/s {rates}")
    lines.append(
        f"acceptance rate {report['acceptance_rate']:.2f}, "
        f"mean accepted length {report['mean_accepted_length']:.2f} tokens per verification"
    )
    return "\n".join(lines)

"""Speculative decoding on the CPU: qinfer with and without it, and llama.cpp's own, in one run.

    python bench/speculative.py                        # the embedded SmolLM2-135M Q4_1
    python bench/speculative.py --model M.gguf --threads 4 --repeats 3 --json

Workloads (greedy, the chat template applied, batch 1 unless said):
- edit: answers that mostly copy their ~256-token prompt ("fix the typos in this
  paragraph", "add type hints to this function"). qinfer with prompt lookup against qinfer
  without, and against llama.cpp with its prompt lookup (llama-cpp-python's
  `LlamaPromptLookupDecoding`) and without.
- chat: questions with nothing to copy; prompt lookup on and off (it must not slow down).
- self: a float32 target (the GGUF dequantized) drafting with the same file's 4-bit blocks
  (`--speculative-model` = the target's file), on and off.
- concurrent: 8 edit and chat requests through `LLM.generate` together, on and off
  (all output tokens / wall seconds, prefill included).

Decode tok/s of a request: (tokens - 1) / seconds from its first token to its last. Each
figure is the best of `--repeats` rounds that alternate between the settings compared.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from qinfer import LLM, SamplingParams, load_tokenizer
from qinfer.checkpoint import resolve_model
from qinfer.linear.compute import cpu_flags

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


def chat_ids(tokenizer, text: str) -> list[int]:
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


def llama_cpp_rate(llama, ids: list[int], max_tokens: int) -> tuple[float, int]:
    """(decode tok/s, tokens) of one greedy llama.cpp completion, streamed."""
    llama.reset()
    first = last = None
    tokens = 0
    for _ in llama.create_completion(ids, max_tokens=max_tokens, temperature=0.0, stream=True):
        now = time.perf_counter()
        first = first or now
        last, tokens = now, tokens + 1
    return (tokens - 1) / (last - first), tokens


def concurrent_rate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)


def best_of(repeats: int, runs: dict) -> dict:
    """Alternate the named runs `repeats` times; each one's best result (a (rate, tokens)
    pair or a rate)."""
    best: dict = {}
    for _ in range(repeats):
        for name, run in runs.items():
            result = run()
            rate = result[0] if isinstance(result, tuple) else result
            if name not in best or rate > best[name][0]:
                best[name] = result if isinstance(result, tuple) else (result, None)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the embedded one)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--k", type=int, default=4, help="qinfer's num_speculative_tokens")
    parser.add_argument("--skip", nargs="*", default=[], choices=["llama", "self", "concurrent"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = str(resolve_model(args.model))
    tokenizer = load_tokenizer(path)
    edit = [chat_ids(tokenizer, text) for text in EDIT]
    chat = [chat_ids(tokenizer, text) for text in CHAT]
    n = args.max_tokens
    ngram = {"method": "ngram", "num_speculative_tokens": args.k}
    plain, lookup = LLM(path), LLM(path, speculative=ngram)
    report = {
        "cpu_flags": cpu_flags(),
        "threads": args.threads,
        "prompt_tokens": {"edit": [len(p) for p in edit], "chat": [len(p) for p in chat]},
    }
    for name, prompts in (("edit", edit), ("chat", chat)):
        runs = {}
        for i, ids in enumerate(prompts):
            runs[f"off/{i}"] = lambda ids=ids: decode_rate(plain, ids, n)
            runs[f"ngram/{i}"] = lambda ids=ids: decode_rate(lookup, ids, n)
        report[name] = best_of(args.repeats, runs)
    report["ngram_acceptance"] = lookup.engine.stats().spec_acceptance_rate
    if "llama" not in args.skip:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        kwargs = dict(n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads)
        llama = Llama(path, verbose=False, **kwargs)
        llama_lookup = Llama(path, verbose=False, draft_model=LlamaPromptLookupDecoding(), **kwargs)
        runs = {}
        for i, ids in enumerate(edit):
            runs[f"llama.cpp/{i}"] = lambda ids=ids: llama_cpp_rate(llama, ids, n)
            runs[f"llama.cpp+lookup/{i}"] = lambda ids=ids: llama_cpp_rate(llama_lookup, ids, n)
        report["edit"].update(best_of(args.repeats, runs))
    if "self" not in args.skip:
        target = LLM(path, dtype="float32")
        drafted = LLM(
            path,
            dtype="float32",
            speculative={"method": "draft", "model": path, "num_speculative_tokens": args.k},
        )
        runs = {}
        for i, ids in enumerate(chat + edit):
            runs[f"fp32/{i}"] = lambda ids=ids: decode_rate(target, ids, n)
            runs[f"fp32+int4-draft/{i}"] = lambda ids=ids: decode_rate(drafted, ids, n)
        report["self"] = best_of(args.repeats, runs)
        report["self_acceptance"] = drafted.engine.stats().spec_acceptance_rate
    if "concurrent" not in args.skip:
        mix = (edit + chat) * 2
        report["concurrent"] = best_of(
            args.repeats,
            {
                "off": lambda: concurrent_rate(plain, mix, n),
                "ngram": lambda: concurrent_rate(lookup, mix, n),
            },
        )
    print(json.dumps(report, indent=2) if args.json else format_report(report))


def format_report(report: dict) -> str:
    lines = [f"CPU flags: {' '.join(report['cpu_flags'])}; {report['threads']} threads"]
    for section in ("edit", "chat", "self", "concurrent"):
        if section not in report:
            continue
        lines.append(
            f"{section} (decode tok/s, tokens):"
            if section != "concurrent"
            else "concurrent (8 requests, tok/s):"
        )
        for name, (rate, tokens) in report[section].items():
            lines.append(f"  {name:24s} {rate:8.1f}" + (f"  {tokens}" if tokens else ""))
    lines.append(f"prompt lookup acceptance: {report['ngram_acceptance']:.2f}")
    if "self_acceptance" in report:
        lines.append(f"int4 self-draft acceptance: {report['self_acceptance']:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

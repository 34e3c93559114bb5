"""Speculative decoding on the CPU: qinfer with and without it, and llama.cpp's own, in one run.

    python bench/speculative.py                        # the embedded SmolLM2-135M Q4_1
    python bench/speculative.py --model M.gguf --threads 4 --repeats 3 --json

Workloads (`qinfer.bench.speculative`: greedy, the chat template applied, batch 1 unless said):
- edit: answers that mostly copy their ~256-token prompt ("fix the typos in this
  paragraph", "add type hints to these functions"). qinfer with prompt lookup against
  qinfer without, and against llama.cpp with its prompt lookup (llama-cpp-python's
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
from qinfer.bench.speculative import best_of, decode_rate, workload_ids
from qinfer.core.checkpoint import resolve_model
from qinfer.linear.compute import cpu_flags


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
    prompts = workload_ids(load_tokenizer(path))
    edit, chat = prompts["edit"], prompts["chat"]
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
        # speculation in llama-cpp-python needs the logits of every row (logits_all)
        llama_lookup = Llama(
            path, verbose=False, draft_model=LlamaPromptLookupDecoding(), logits_all=True, **kwargs
        )
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

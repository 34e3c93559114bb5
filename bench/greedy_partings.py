"""Where greedy decoding leaves the fp32 reference's path, for qinfer's default load and for
llama.cpp on the same GGUF file: the measure of tests/test_numerics.py, with the peer beside.

    python bench/greedy_partings.py                   # the embedded SmolLM2 Q4_1
    python bench/greedy_partings.py --model ~/.cache/qinfer/gemma-3-270m-q4_k_m.gguf

The prompts are tests/chat_prompts.txt, each through the model's chat template. The
reference is qinfer with the file dequantized to fp32 (`dtype="float32"`), its first
--tokens greedy tokens and, at each step, the gap between its two highest logits. An engine
"parts" from it at the first step where it picks another token; a parting at a small gap
is a near-tie that any rounding may flip. Printed per engine: how many prompts part within
the tokens, and the fp32 gap at each parting (the issue's criterion: every gap under 0.05).
llama.cpp runs the same prompt ids through llama-cpp-python (`pip install 'qinfer[peer]'`),
greedy by argmax of its logits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from qinfer import LLM, SamplingParams
from qinfer.bench.greedy import partings, top_two_gaps
from qinfer.core.checkpoint import resolve_model

PROMPTS = Path(__file__).resolve().parent.parent / "tests" / "chat_prompts.txt"


def llama_cpp_greedy(path: Path, prompts: list[list[int]], tokens: int, threads: int):
    """Each prompt's first `tokens` greedy tokens from llama.cpp."""
    import llama_cpp

    # logits_all: `scores` then holds a row per position (else only the batch's rows)
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=256, logits_all=True, n_threads=threads, verbose=False
    )
    out = []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        chosen = []
        for _ in range(tokens):
            chosen.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(chosen[-1:])
        out.append(chosen)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default SmolLM2 Q4_1)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    path = resolve_model(args.model)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS.read_text().splitlines()]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    with_logprobs = dataclasses.replace(params, logprobs=2)

    llm = LLM(str(path), dtype="float32")
    outputs = llm.generate(chats, with_logprobs, use_tqdm=False)
    llm.close()
    reference = [o.token_ids for o in outputs]
    prompt_ids = [o.prompt_token_ids for o in outputs]
    gaps = top_two_gaps(outputs)

    llm = LLM(str(path))
    rows = {"qinfer default": [o.token_ids for o in llm.generate(chats, params, use_tqdm=False)]}
    llm.close()
    try:
        rows["llama.cpp"] = llama_cpp_greedy(path, prompt_ids, args.tokens, args.threads)
    except ImportError:
        print("llama.cpp: skipped (pip install 'qinfer[peer]')")
    found = {name: partings(reference, gaps, got) for name, got in rows.items()}
    if args.json:
        print(json.dumps(found, indent=2))
        return
    print(f"{path.name}: {len(chats)} chat prompts, {args.tokens} greedy tokens each")
    for name, parted in found.items():
        largest = max((gap for *_, gap in parted), default=0.0)
        shown = [(p, step, round(gap, 4)) for p, step, gap in parted]
        print(
            f"{name:>15}: {len(parted)} of {len(chats)} part from fp32, largest gap {largest:.4f}"
        )
        print(f"{'':>15}  (prompt, step, gap): {shown}")


if __name__ == "__main__":
    main()

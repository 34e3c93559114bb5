"""The cost of constrained decoding: mask time per token and tokens/s with and without a
JSON schema, through `qinfer.LLM`.

    python bench/structured.py                          # the embedded SmolLM2
    python bench/structured.py --model path/to/Qwen3-0.6B --batch 16 --max-tokens 128

The same chat prompts run twice, unconstrained and under a JSON schema, at temperature 1
with one seed per request. The mask time is the time of `GrammarProcessor.__call__`
(llguidance's bitmask for the row, then unpacking and applying it), measured on every
call; the rest of a constrained step is the same work as an unconstrained one.
"""

from __future__ import annotations

import argparse
import statistics
import time

from qinfer import LLM, SamplingParams
from qinfer.grammar import GrammarProcessor

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "address"],
}
PROMPT = [{"role": "user", "content": "Describe a made-up person as JSON."}]


def timed_masks() -> list[float]:
    """Record the seconds of every GrammarProcessor call from now on."""
    seconds: list[float] = []
    call = GrammarProcessor.__call__

    def timed(self, logits):
        start = time.perf_counter()
        out = call(self, logits)
        seconds.append(time.perf_counter() - start)
        return out

    GrammarProcessor.__call__ = timed
    return seconds


def run(llm: LLM, batch: int, max_tokens: int, schema: dict | None) -> tuple[float, int]:
    """(seconds, generated tokens) of one batch of sampled requests."""
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, json_schema=schema)
        for seed in range(batch)
    ]
    start = time.perf_counter()
    outputs = llm.generate([PROMPT] * batch, params, use_tqdm=False)
    return time.perf_counter() - start, sum(o.num_generated_tokens for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: embedded SmolLM2)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args()

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.batch)
    run(llm, 2, 8, SCHEMA)  # warm-up: weights, llguidance's tokenizer, the first masks
    masks = timed_masks()
    for name, schema in (("free", None), ("schema", SCHEMA)):
        seconds, tokens = run(llm, args.batch, args.max_tokens, schema)
        print(f"{name:>7}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s")
    ms = sorted(1000 * s for s in masks)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    print(
        f"   mask: {len(ms)} calls, p50 {statistics.median(ms):.3f} ms, p99 {p99:.3f} ms "
        f"per token per request"
    )


if __name__ == "__main__":
    main()

"""The cost of constrained decoding: mask time per token and tokens/s with and without a
JSON schema, through `qinfer.LLM`.

    python bench/structured.py                          # the embedded SmolLM2
    python bench/structured.py --model path/to/Qwen3-0.6B --batch 16 --max-tokens 128

The same chat prompts run twice, unconstrained and under a JSON schema, at temperature 1
with one seed per request. Two times per token per request are reported: the mask, as the
worker thread computes it while the model runs (`GrammarProcessor._forbidden`:
llguidance's bitmask for the row, unpacked), and what the sampler spends in
`GrammarProcessor.__call__` (waiting for that mask if it is not ready yet, then applying
it), which is all a constrained step adds to an unconstrained one on the sampling thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

from qinfer import LLM, SamplingParams
from qinfer.request.grammar import GrammarProcessor

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
#: For a checkpoint without a chat template (a base model such as Gemma 3 270M's GGUF).
TEXT_PROMPT = "A made-up person, described as JSON: "


def timed(cls: type, name: str) -> list[float]:
    """Record the seconds of every call of method `name` of `cls` from now on."""
    seconds: list[float] = []
    method = getattr(cls, name)

    def timed_method(self, *args):
        start = time.perf_counter()
        out = method(self, *args)
        seconds.append(time.perf_counter() - start)
        return out

    setattr(cls, name, timed_method)
    return seconds


def percentiles(seconds: list[float]) -> str:
    ms = sorted(1000 * s for s in seconds)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    return f"{len(ms)} calls, p50 {statistics.median(ms):.3f} ms, p99 {p99:.3f} ms"


def run(llm: LLM, batch: int, max_tokens: int, schema: dict | None) -> tuple[float, int]:
    """(seconds, generated tokens) of one batch of sampled requests."""
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, json_schema=schema)
        for seed in range(batch)
    ]
    chat = llm.engine.tokenizer.chat_template is not None
    start = time.perf_counter()
    outputs = llm.generate([PROMPT if chat else TEXT_PROMPT] * batch, params, use_tqdm=False)
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
    masks = timed(GrammarProcessor, "_forbidden")
    applied = timed(GrammarProcessor, "__call__")
    for name, schema in (("free", None), ("schema", SCHEMA)):
        seconds, tokens = run(llm, args.batch, args.max_tokens, schema)
        print(f"{name:>7}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s")
    print(f"   mask (worker thread): {percentiles(masks)} per token per request")
    print(f"sampler (wait + apply): {percentiles(applied)} per token per request")


if __name__ == "__main__":
    main()

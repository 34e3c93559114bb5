"""Decode speed with a Qwen3.5 file's own MTP head drafting (`--speculative-method mtp`) and
without, on token ids (the bench file's tokenizer has no chat template), in one run.

    python bench/make_qwen3_5_gguf.py --mtp /tmp/qwen3.5-0.8b-mtp-q4_0.gguf
    python bench/mtp_draft.py /tmp/qwen3.5-0.8b-mtp-q4_0.gguf --k 1 2 --repeats 2

The model loads once, with its head; one engine decodes without speculation, one per k with
it. Decode tok/s of a request: (tokens - 1) / seconds from its first token to its last
(`qinfer.bench.speculative.decode_rate`), the best of `--repeats` rounds that alternate
between the settings. A random-weight head's guesses are random: its acceptance says
nothing of a released checkpoint's, and the speed-up measured is the cost of proposing
and verifying with almost nothing kept (the floor), not the gain.
"""

from __future__ import annotations

import argparse

import torch

from qinfer import LLM, load_model
from qinfer.bench.speculative import best_of, decode_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a Qwen3.5 checkpoint or .gguf file with an MTP head")
    parser.add_argument("--k", type=int, nargs="+", default=[2], help="num_speculative_tokens")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model = load_model(args.model, mtp=True)
    ids = torch.randint(0, 256, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))
    prompt = ids.tolist()
    engines = {"off": LLM(model)}
    for k in args.k:
        speculative = {"method": "mtp", "num_speculative_tokens": k}
        engines[f"mtp k={k}"] = LLM(model, speculative=speculative)
    runs = {
        name: lambda llm=llm: decode_rate(llm, prompt, args.max_tokens)
        for name, llm in engines.items()
    }
    rates = best_of(args.repeats, runs)
    base = rates["off"][0]
    print(f"{args.model}: {args.prompt_tokens}-token prompt, {args.max_tokens} tokens, greedy")
    for name, (rate, tokens) in rates.items():
        line = f"{name}: {rate:.1f} tok/s ({tokens} tok, {rate / base:.2f}x)"
        if name != "off":
            stats = engines[name].engine.stats()
            line += (
                f"; proposed {stats.spec_proposed_tokens_total}, accepted "
                f"{stats.spec_accepted_tokens_total} ({stats.spec_acceptance_rate:.2f})"
            )
        print(line)


if __name__ == "__main__":
    main()

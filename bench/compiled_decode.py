"""Does `torch.compile` pay for decode on the CPU? Batch-1 decode of the embedded model, eager
against each decoder block compiled by inductor, with its default Python wrapper and with
the C++ wrapper (`torch._inductor.config.cpp_wrapper`).

    python bench/compiled_decode.py [--model M] [--threads 2] [--tokens 64] [--repeats 3]

Each block is compiled whole (`Block.compile()`), except the paged attention backend's
`attend`, which is left eager: its grouping of sequences is host logic over the step's
block tables (a graph break, not a graph). What is compiled is then everything else of a
decode step's layers: norms, the q/k/v projection, QK-norm, RoPE, the output projection,
the MLP and the residuals, at one fixed shape (one token), i.e. the Python dispatch the
issue asks about. Printed: the compile time (the first generation, which compiles), and
the best decode tok/s of `--repeats` generations after it, for each setting, and the CPU.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from qinfer import SamplingParams, load_model
from qinfer.attention.paged import PagedAttention
from qinfer.checkpoint import default_model
from qinfer.generation import generate_ids
from qinfer.linear.compute import cpu_flags


def decode_tok_s(model, prompt: list[int], tokens: int) -> float:
    """Greedy decode tok/s of one sequence after `prompt` (the first token is the prefill's)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    (result,) = generate_ids(model, [prompt], params)
    return (tokens - 1) / result.timings.decode_seconds


def measure(model, prompt: list[int], tokens: int, repeats: int) -> tuple[float, float]:
    """(seconds of the first generation, best decode tok/s of the next `repeats`)."""
    start = time.perf_counter()
    decode_tok_s(model, prompt, tokens)
    first = time.perf_counter() - start
    return first, max(decode_tok_s(model, prompt, tokens) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(default_model()))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, device="cpu")
    prompt = [int(t) for t in torch.randint(100, model.config.vocab_size, (args.prompt_tokens,))]
    rows = {"cpu": cpu_flags(), "threads": args.threads}

    rows["eager"] = measure(model, prompt, args.tokens, args.repeats)
    # The backend's host logic stays eager (see the docstring).
    PagedAttention.attend = torch.compiler.disable(PagedAttention.attend)
    # One compiled graph per block and shape (each block's layer index is a constant of its
    # graph): 30 blocks x (prefill, decode) graphs, past dynamo's default limit of 8.
    torch._dynamo.config.recompile_limit = 4 * len(model.layers)
    for wrapper in ("python", "cpp"):
        torch._dynamo.reset()
        torch._inductor.config.cpp_wrapper = wrapper == "cpp"
        for block in model.layers:
            block.compile(dynamic=False)
        rows[f"compiled, {wrapper} wrapper"] = measure(model, prompt, args.tokens, args.repeats)
    for name, value in rows.items():
        if isinstance(value, tuple):
            first, best = value
            print(f"{name:>26}: first generation {first:6.1f} s, decode {best:6.1f} tok/s")
        else:
            print(f"{name:>26}: {value}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

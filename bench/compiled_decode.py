"""Does `torch.compile` pay for decode on the CPU? Batch-1 decode, eager against two ways of
compiling it with inductor, each with its default Python wrapper and with its C++ wrapper
(`torch._inductor.config.cpp_wrapper`, which calls every kernel from C++):

    python bench/compiled_decode.py [--model M] [--threads 2] [--tokens 64] [--repeats 3]
                                    [--routes step,blocks]

- step: the whole decode step, one graph per bucket of the static decode step
  (`qinfer.runtime.static_decode`): every layer with the paged attention as the CPU's decode
  op (a custom op, traced through its fake kernel), the final norm and the head. The
  runner's graph seam (`qinfer.runtime.cuda_graphs.Graph`, which CUDA graphs fill on a
  GPU) takes a graph that compiles the step when its bucket is first seen and runs the
  compiled step at each replay.
- blocks: each decoder block compiled whole (`Block.compile()`), except the paged
  attention backend's `attend`, left eager (a graph break per layer).

Printed: the first generation's seconds (it compiles), and the best decode tok/s of
`--repeats` generations after it, for each setting, and the CPU. Compiled graphs are cached
on disk by inductor: a second run of this script compiles faster (the first generation's
time says which).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from qinfer import SamplingParams, load_model
from qinfer.attention.paged import PagedAttention
from qinfer.core.checkpoint import default_model
from qinfer.engine import Engine, EngineConfig
from qinfer.engine.run import run_to_end
from qinfer.linear.compute import cpu_flags
from qinfer.runtime.cuda_graphs import StepGraphs


class CompiledStep:
    """A `Graph` of the bucketed decode step: `capture` compiles the step (whole, one fixed
    shape) and runs it once; `replay` runs the compiled step, its logits copied into the
    first run's output (what `StepGraphs` hands out)."""

    def capture(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.step = torch.compile(run, fullgraph=True, dynamic=False)
        self.output = self.step()
        return self.output

    def replay(self) -> None:
        self.output.copy_(self.step())


def decode_tok_s(engine: Engine, prompt: list[int], tokens: int) -> float:
    """Greedy decode tok/s of one sequence after `prompt` (the first token is the prefill's)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    (result,) = run_to_end(engine, [engine.make_request(prompt, params)])
    return (tokens - 1) / result.timings.decode_seconds


def measure(engine: Engine, prompt: list[int], tokens: int, repeats: int) -> tuple[float, float]:
    """(seconds of the first generation, best decode tok/s of the next `repeats`)."""
    start = time.perf_counter()
    decode_tok_s(engine, prompt, tokens)
    first = time.perf_counter() - start
    return first, max(decode_tok_s(engine, prompt, tokens) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(default_model()))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--routes", default="step,blocks", help="step, blocks or both")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, device="cpu")
    prompt = [int(t) for t in torch.randint(100, model.config.vocab_size, (args.prompt_tokens,))]
    rows: dict = {"cpu": cpu_flags(), "threads": args.threads}
    routes = args.routes.split(",")

    def engine(static_decode: bool = False) -> Engine:
        config = EngineConfig(
            max_num_seqs=1,
            max_num_batched_tokens=max(512, args.prompt_tokens),
            num_kv_blocks=-(-(args.prompt_tokens + args.tokens) // EngineConfig.block_size),
            static_decode=static_decode,
            cuda_graphs=False,
        )
        return Engine(model, None, config)

    rows["eager"] = measure(engine(), prompt, args.tokens, args.repeats)
    wrappers = ("python", "cpp")
    if "step" in routes:
        for wrapper in wrappers:
            torch._dynamo.reset()
            torch._inductor.config.cpp_wrapper = wrapper == "cpp"
            stepped = engine(static_decode=True)
            stepped.executor.runner.graphs = StepGraphs(new_graph=CompiledStep)
            rows[f"step compiled, {wrapper} wrapper"] = measure(
                stepped, prompt, args.tokens, args.repeats
            )
    if "blocks" in routes:  # last: it compiles the model's blocks in place
        # The backend's host logic stays eager (see the docstring).
        PagedAttention.attend = torch.compiler.disable(PagedAttention.attend)
        # One compiled graph per block and shape (each block's layer index is a constant of
        # its graph): 30 blocks x (prefill, decode) graphs, past dynamo's default limit of 8.
        torch._dynamo.config.recompile_limit = 4 * len(model.layers)
        for wrapper in wrappers:
            torch._dynamo.reset()
            torch._inductor.config.cpp_wrapper = wrapper == "cpp"
            for block in model.layers:
                block.compile(dynamic=False)
            rows[f"blocks compiled, {wrapper} wrapper"] = measure(
                engine(), prompt, args.tokens, args.repeats
            )
    for name, value in rows.items():
        if isinstance(value, tuple):
            first, best = value
            print(f"{name:>30}: first generation {first:6.1f} s, decode {best:6.1f} tok/s")
        else:
            print(f"{name:>30}: {value}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

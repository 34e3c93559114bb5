"""Where a forward's time goes, by kind of layer part: a prompt's prefill and a few decode
steps of a GGUF (or folder) model, timed around each Gated DeltaNet, attention, MLP and
the head.

    python bench/layer_times.py --model /tmp/qwen3.5-0.8b-q4_0.gguf [--prompt 512] [--steps 16]

Each part is timed by forward hooks (wall seconds between the pre-hook and the hook, summed
over its layers); the rest of the forward (norms, the embedding, the residual adds) is the
remainder. The model's default load; 2 threads unless told otherwise.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict

import torch

from qinfer import load_model
from qinfer.layers.attention import Attention
from qinfer.layers.gated_deltanet import GatedDeltaNet
from qinfer.layers.mlp import MLP
from qinfer.layers.moe import SparseMoE

PARTS = {GatedDeltaNet: "DeltaNet", Attention: "attention", MLP: "MLP", SparseMoE: "MoE"}


def hooked(model: torch.nn.Module) -> dict[str, float]:
    """Seconds spent in each part (PARTS, and the head), accumulated as the model runs."""
    seconds: dict[str, float] = defaultdict(float)
    started: dict[int, float] = {}
    modules = [(m, PARTS[type(m)]) for m in model.modules() if type(m) in PARTS]
    modules.append((model.lm_head, "head"))
    for module, part in modules:

        def before(m: torch.nn.Module, args: tuple) -> None:
            started[id(m)] = time.perf_counter()

        def after(m: torch.nn.Module, args: tuple, out, part: str = part) -> None:
            seconds[part] += time.perf_counter() - started.pop(id(m))

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)
    return seconds


def report(what: str, total: float, seconds: dict[str, float], tokens: int) -> None:
    parts = ", ".join(f"{p} {s * 1e3:.1f} ms ({s / total:.0%})" for p, s in seconds.items())
    rest = total - sum(seconds.values())
    print(
        f"{what}: {total * 1e3:.1f} ms, {tokens / total:.1f} tok/s: {parts}, rest {rest * 1e3:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="the best run of each counts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, device="cpu")
    seconds = hooked(model)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=generator)
    best: dict[str, tuple[float, dict[str, float], int]] = {}

    def timed(what: str, tokens: int, run) -> torch.Tensor:
        """run(), its seconds and its parts' kept where they are the best so far."""
        seconds.clear()
        start = time.perf_counter()
        out = run()
        total = time.perf_counter() - start
        if what not in best or total < best[what][0]:
            best[what] = (total, dict(seconds), tokens)
        return out

    def decode(cache: list, token: torch.Tensor) -> torch.Tensor:
        for _ in range(args.steps):
            logits = model(token, cache=cache, last_only=True)
            token = logits[:, -1].argmax(-1, keepdim=True)
        return token

    for _ in range(args.repeats):
        cache = model.make_cache(1, max_length=args.prompt + args.steps)
        prefill = functools.partial(model, prompt, cache=cache, last_only=True)
        logits = timed("prefill", args.prompt, prefill)
        first = logits[:, -1].argmax(-1, keepdim=True)
        timed("decode", args.steps, functools.partial(decode, cache, first))
    print(f"{args.model}, {args.threads} threads, best of {args.repeats}, dtype {model.dtype}")
    for what, (total, parts, tokens) in best.items():
        report(what, total, parts, tokens)


if __name__ == "__main__":
    main()

"""Time to first token of a long system prompt: cold, from the prefix cache in memory, and
from the prompt cache on disk after a restart (a new engine on the same --prompt-cache-dir);
for a hybrid model (Qwen3.5) the disk holds the state after the prompt's blocks too.

    python bench/make_qwen3_0p6b_gguf.py /tmp/qwen3-0.6b-q4_0.gguf
    python bench/prompt_cache_disk.py --model /tmp/qwen3-0.6b-q4_0.gguf --tokens 2000

The prompt is random token ids; each run generates one token (its time: the prefill plus
one sampling). The restart is a new `LLM` of the same file in this process (its load is
not what is measured).
Each engine first runs a short unrelated prompt (`--no-warm-up`: not): a fresh engine's
first step of a new row count pays one-time costs (first calls of the kernels at that
shape: seconds on Qwen3-0.6B) that are not the prompt's.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from qinfer.engine import LLM
from qinfer.request.sampling import SamplingParams


def first_token_seconds(llm: LLM, prompt: list[int]) -> tuple[float, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    return time.perf_counter() - start, output.token_ids


def warm_up_prompt(rng: random.Random) -> list[int]:
    """A short prompt of its own (never on disk): the steps the measured ones are warmed by
    run 20 new tokens, as a cold engine's first would."""
    return [rng.randrange(1000, 100000) for _ in range(20)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument(
        "--dir", default=None, help="the prompt cache dir (default: a temporary one)"
    )
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false")
    args = parser.parse_args()
    directory = Path(args.dir or tempfile.mkdtemp(prefix="qinfer-prompt-cache-"))
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 100000) for _ in range(args.tokens)]

    llm = LLM(args.model, prompt_cache_dir=directory)
    if args.warm_up:
        first_token_seconds(llm, warm_up_prompt(rng))
    cold, first = first_token_seconds(llm, prompt)
    memory, again = first_token_seconds(llm, prompt)
    start = time.perf_counter()
    llm.close()  # the writes queued still go to disk
    flushed = time.perf_counter() - start
    files = list(directory.rglob("*.kvb"))
    states = list(directory.rglob("*.kvs"))  # a hybrid model's states after blocks
    del llm  # the restart: the model loads again, its time not counted
    restarted = LLM(args.model, prompt_cache_dir=directory)
    if args.warm_up:
        first_token_seconds(restarted, warm_up_prompt(rng))
    before = restarted.engine.stats()
    disk, read = first_token_seconds(restarted, prompt)
    stats = restarted.engine.stats()
    restarted.close()
    assert first == again == read, (first, again, read)
    print(
        f"prompt {args.tokens} tokens; {len(files)} block files, "
        f"{sum(f.stat().st_size for f in files) / 1e6:.1f} MB; {len(states)} state files, "
        f"{sum(f.stat().st_size for f in states) / 1e6:.1f} MB; close waited {flushed:.2f} s"
    )
    print(f"cold    {cold:8.3f} s")
    print(f"memory  {memory:8.3f} s  ({cold / memory:.1f}x)")
    read_tokens = stats.prompt_tokens_from_disk_total - before.prompt_tokens_from_disk_total
    computed = stats.prompt_tokens_computed_total - before.prompt_tokens_computed_total
    print(
        f"disk    {disk:8.3f} s  ({cold / disk:.1f}x; {read_tokens} tokens read, "
        f"{computed} computed)"
    )


if __name__ == "__main__":
    main()

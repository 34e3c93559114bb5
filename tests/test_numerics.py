"""One answer on every machine: the default path's greedy text is the same in every process,
follows fp32's except after near ties, and does so under each emulated CPU class too.

The reference is the same GGUF file dequantized to fp32 (`dtype="float32"`); the default path
keeps its int4/int8 blocks exactly and multiplies them by fp32 activations (qinfer's compiled
kernels; bf16 on torch's where no compiler builds them) with an fp32 residual stream and fp32
logits. The emulated classes cap the ISA that torch's libraries use (ONEDNN_MAX_CPU_ISA for
oneDNN's GEMMs, ATEN_CPU_CAPABILITY for torch's own kernels), which moves the kernel choices
(`qinfer.linear.compute.cpu_class`) and the rounding with them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_files import smollm2_path

from qinfer import LLM, SamplingParams, kernels, load_model, load_tokenizer
from qinfer.bench.greedy import partings, top_two_gaps

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = pytest.mark.slow

#: 20 short chat prompts, one per line (bench/greedy_partings.py reads the same file).
PROMPTS = (Path(__file__).parent / "chat_prompts.txt").read_text().splitlines()
TOKENS = 32
#: fp32's top-two gap (logits) below which `exact=True` may choose the other token: the
#: issue's 0.05. `exact` multiplies the file's exact weights by fp32 activations
#: (`Int4BlockLinear`, `Int8BlockLinear`) with a bf16 KV cache; measured on SmolLM2 (AMD EPYC,
#: 2026-12-03, and under each emulated class): 2 of 20 prompts part within 32 tokens, at gaps
#: of 0.0002-0.010. Before, with bf16 activations and torch's int4 kernel (bf16 scales and
#: outputs): 8 of 20, up to 0.087; llama.cpp on the same file parts on 16 of 20, at gaps up
#: to 0.226 (`python bench/greedy_partings.py`).
NEAR_TIE = 0.05
#: llama.cpp's own partings from fp32 on the same 20 prompts: how many, and the widest gap.
#: The default path (int8 activations, as llama.cpp's) may part no more often and only at
#: gaps below that: measured 16 of 20, at gaps up to 0.128 (Intel Xeon, AVX512-VNNI,
#: 2026-12-05).
LLAMA_CPP_PARTINGS, LLAMA_CPP_GAP = 16, 0.226
#: The emulated CPU classes of the issue (AVX512_CORE: AVX-512 without bf16).
EMULATED = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "onednn-avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512-core": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
}
#: Prompts run under each emulated class: oneDNN capped below bf16 runs bf16 GEMMs ~100x
#: slower than a real AVX2 CPU does, so a subset.
EMULATED_PROMPTS = 6

GREEDY = """
import json, sys
from qinfer import LLM, SamplingParams, kernels, load_model, load_tokenizer
prompts = json.loads(sys.argv[2])
params = SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0, ignore_eos=True)
outputs = LLM(sys.argv[1]).generate([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
print(json.dumps([output.token_ids for output in outputs]))
"""


def chat(prompts: list[str]) -> list[list[dict]]:
    return [[{"role": "user", "content": prompt}] for prompt in prompts]


@pytest.fixture(scope="module")
def fp32_greedy():
    """Each prompt's fp32 greedy tokens, with the gap between the top two logits at each."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    llm = LLM(str(smollm2_path()), dtype="float32")
    outputs = llm.generate(chat(PROMPTS), params, use_tqdm=False)
    llm.close()
    return [output.token_ids for output in outputs], top_two_gaps(outputs)


def default_greedy_in_a_process(environ: dict[str, str], prompts: list[str]) -> list[list[int]]:
    done = subprocess.run(
        [sys.executable, "-c", GREEDY, str(smollm2_path()), json.dumps(prompts), str(TOKENS)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **environ},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_default_generate_prints_the_same_text_in_ten_fresh_processes():
    """`qinfer generate` with its defaults (the embedded model, greedy) in 10 processes: the
    kernel choices are a table of the CPU, so nothing a process measures moves the text.
    (64 tokens each, not the default 256: the model loops well before, and the processes'
    start-up is what the test is about.)
    (One after another: two at once on two cores would oversubscribe them, each process's
    2 threads spinning at barriers for a descheduled partner.)"""
    texts = {generated() for _ in range(10)}
    assert len(texts) == 1, texts
    # the reference mode answers as fp32 does; the default's int8 activations flip the first
    # token, a near-tie (fp32: 0.08 nats between the top two), and the 135M model then loops
    assert "Paris" in generated("--exact")


def generated(*flags: str) -> str:
    """What `qinfer generate` prints for the question (64 tokens), in a fresh process."""
    question = "What is the capital of France?"
    done = subprocess.run(
        [sys.executable, "-m", "qinfer.cli", "generate", "--max-tokens", "64", *flags, question],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.mark.parametrize("exact", [False, True], ids=["int8_activations", "exact"])
def test_default_greedy_follows_fp32_except_after_near_ties(fp32_greedy, exact):
    """The default path parts from fp32's greedy text no more often than llama.cpp does and
    only at gaps llama.cpp parts at; `exact` on at most a quarter of the prompts, at gaps
    under NEAR_TIE."""
    reference, gaps = fp32_greedy
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(str(smollm2_path()), exact=exact)
    got = [output.token_ids for output in llm.generate(chat(PROMPTS), params, use_tqdm=False)]
    llm.close()
    found = partings(reference, gaps, got)
    print(f"{len(found)} of {len(PROMPTS)} prompts part from fp32 within {TOKENS} tokens: {found}")
    widest, most = (NEAR_TIE, len(PROMPTS) // 4) if exact else (LLAMA_CPP_GAP, LLAMA_CPP_PARTINGS)
    assert all(gap < widest for _, _, gap in found), found
    assert len(found) <= most, found


@pytest.mark.parametrize("cpu", sorted(EMULATED))
def test_an_emulated_cpu_class_answers_alike_in_two_processes_and_follows_fp32(fp32_greedy, cpu):
    """Under each emulated class: two fresh processes give the same tokens (the default
    path), and those part from fp32's only at gaps llama.cpp parts at."""
    reference, gaps = fp32_greedy
    prompts = PROMPTS[:EMULATED_PROMPTS]
    first = default_greedy_in_a_process(EMULATED[cpu], prompts)
    assert default_greedy_in_a_process(EMULATED[cpu], prompts) == first
    found = partings(reference[:EMULATED_PROMPTS], gaps, first)
    print(f"{cpu}: {len(found)} of {len(prompts)} prompts part from fp32: {found}")
    assert all(gap < LLAMA_CPP_GAP for _, _, gap in found), found


#: A prompt of ~300 tokens, to sit beside the short ones: a step's budget of 40 tokens cuts
#: it into chunks (`alike_chunked_cached_preempted_and_speculated`).
LONG = " ".join(PROMPTS) * 2

#: Batches (lists of prompt indices) each prompt is checked in.
COMPOSITIONS = {
    "alone": lambda n: [[i] for i in range(n)],
    "in fours": lambda n: [list(range(i, min(i + 4, n))) for i in range(0, n, 4)],
    "all": lambda n: [list(range(n))],
    "all, reversed": lambda n: [list(range(n))[::-1]],
}


def same_in_every_batch(path, prompts, compositions) -> None:
    """Each prompt's 24 greedy tokens equal in every batch, their logprobs within 1e-6. Each
    prompt runs in one pass (no prefix caching, a step budget that holds every prompt):
    where a prompt's chunks begin is what only batch_invariant keeps from mattering."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    llm = LLM(str(path), enable_prefix_caching=False, max_num_batched_tokens=4096)
    seen: dict[int, tuple[list[int], list[float]]] = {}
    for name, batches in compositions.items():
        for batch in batches:
            outputs = llm.generate([prompts[i] for i in batch], params, use_tqdm=False)
            for i, output in zip(batch, outputs, strict=True):
                got = output.token_ids, [lp.logprob for lp in output.logprobs]
                seen.setdefault(i, got)
                assert got[0] == seen[i][0], (name, i)
                drift = max(abs(a - b) for a, b in zip(got[1], seen[i][1], strict=True))
                assert drift <= 1e-6, (name, i, drift)
    llm.close()


@pytest.mark.parametrize(
    ("model", "count", "as_chat"), [("smollm2", 20, True), ("gemma3", 6, False)]
)
def test_a_request_gets_the_same_tokens_and_logprobs_in_any_batch(
    monkeypatch, model, count, as_chat
):
    """The default path: the int4 groups' int8_dot and the int8 blocks' exact kernel compute
    a row alike at any row count (int8 activations rounded per row, fp32 ones taken as they
    are), so no layer takes a tile GEMM (which blocks by row count) at prefill; paged decode reads whole blocks of keys and pads a group's histories with keys
    of weight 0; the head takes its kernel at every row count. Without a compiler the
    layers compute in bf16 on torch's kernels and the int8 ones take bf16 tiles for calls
    of over 16 rows, so there they are held to their kernel (QINFER_LINEAR_PATH=kernel)."""
    from gguf_files import gemma3_path

    if not kernels.buildable():
        monkeypatch.setenv("QINFER_LINEAR_PATH", "kernel")
    path = smollm2_path() if model == "smollm2" else gemma3_path()
    prompts = chat(PROMPTS[:count]) if as_chat else PROMPTS[:count]
    same_in_every_batch(path, prompts, {name: f(count) for name, f in COMPOSITIONS.items()})


def alike_chunked_cached_preempted_and_speculated(path, prompts: list, **load) -> None:
    """With `batch_invariant=True` (and `load`), each of three prompts (the last a long one)
    gives the tokens and logprobs it gives alone, bit for bit, when they run side by side,
    when the step's budget cuts them into chunks of 40 tokens, after a prefix-cache hit,
    when a pool of blocks of 4 tokens that holds the three prompts but not their 16 new
    tokens each preempts and recomputes them, and when n-gram speculation verifies several
    tokens at a time."""
    checked = [0, 1, 2]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)

    lengths: dict[int, int] = {}  # each prompt's tokens

    def run(llm: LLM, batch: list[int]) -> dict[int, tuple[list[int], list[float]]]:
        outputs = llm.generate([prompts[i] for i in batch], params, use_tqdm=False)
        lengths.update((i, len(o.prompt_token_ids)) for i, o in zip(batch, outputs, strict=True))
        return {
            i: (o.token_ids, [lp.logprob for lp in o.logprobs])
            for i, o in zip(batch, outputs, strict=True)
        }

    tokenizer = None if isinstance(prompts[0][0], int) else load_tokenizer(path)
    model = load_model(path, batch_invariant=True, **load)  # loaded once, for every engine

    def engine(**engine_args) -> LLM:
        return LLM(model, tokenizer, **engine_args)

    llm = engine()
    alone = {i: run(llm, [i])[i] for i in checked}
    runs = {"side by side": run(llm, checked), "prefix-cache hit": run(llm, checked[::-1])}
    llm.close()
    chunked = engine(max_num_batched_tokens=40)
    runs["chunks of 40"] = run(chunked, checked)
    chunked.close()
    fits = sum(-(-n // 4) for n in lengths.values()) + 3  # blocks of 4 the prompts take, and a few
    small = engine(block_size=4, num_kv_blocks=fits, enable_prefix_caching=False)
    runs["preempted"] = run(small, checked)
    assert small.engine.stats().preemptions_total > 0
    small.close()
    speculated = engine(speculative={"method": "ngram"})
    runs["speculated"] = run(speculated, checked)
    speculated.close()
    for name, got in runs.items():
        for i in checked:
            assert got[i][0] == alone[i][0], (name, i)
            drift = max(abs(a - b) for a, b in zip(got[i][1], alone[i][1], strict=True))
            assert drift == 0, (name, i, drift)


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_batch_invariant_keeps_a_request_alike_chunked_cached_preempted_and_speculated(model):
    """`batch_invariant=True` (`Features.batch_invariant`) on the GGUFs' int4/int8 blocks:
    two short prompts and a long one (chat prompts for SmolLM2, plain text for Gemma 3)."""
    from gguf_files import gemma3_path

    if model == "smollm2":
        alike_chunked_cached_preempted_and_speculated(smollm2_path(), chat([*PROMPTS[:2], LONG]))
    else:
        long = " ".join(PROMPTS[2:8])  # ~100 tokens: Gemma's 262k-row head costs more
        alike_chunked_cached_preempted_and_speculated(gemma3_path(), [*PROMPTS[:2], long])


#: Token-id prompts for the random checkpoints: 9, 17 and 130 tokens, the long one
#: repeating a stretch for the n-gram speculator to find.
RANDOM_PROMPTS = [
    [(7 * i + 3) % 200 + 20 for i in range(9)],
    [(11 * i + 5) % 200 + 20 for i in range(17)],
    [(13 * i + 1) % 90 + 20 for i in range(130)],
]


@pytest.mark.parametrize(
    ("family", "load"),
    [
        ("qwen3", {"dtype": "float32"}),
        ("qwen3", {"dtype": "bfloat16"}),
        ("qwen3", {"dtype": "float32", "kv_cache_dtype": "int8"}),
        ("qwen3_moe", {"dtype": "float32"}),
        ("qwen3_moe", {"dtype": "bfloat16"}),
    ],
)
def test_batch_invariant_keeps_dense_and_moe_checkpoints_alike(tmp_path, family, load):
    """Random Qwen3 and Qwen3-MoE checkpoints: dense GEMMs (experts' included) in fixed
    chunks of rows, and an int8 KV cache's values summed in fp64."""
    from checkpoints import QWEN3_MOE, build_checkpoint

    overrides = QWEN3_MOE if family == "qwen3_moe" else {}
    build_checkpoint(tmp_path, family, **overrides)
    alike_chunked_cached_preempted_and_speculated(tmp_path, RANDOM_PROMPTS, **load)

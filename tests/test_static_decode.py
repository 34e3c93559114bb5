"""The shape-static decode step (`qinfer.runtime.static_decode`): decode steps padded to
buckets of batch sizes and table widths.

- the bucketed engine gives the dynamic engine's greedy tokens on every family of the
  cache tests (sliding windows and block spaces, experts, Gemma 3's two RoPE bases);
- a bucketed decode step of a seen bucket makes no tensor and reads nothing back to the
  host (a torch function mode counts factory calls and syncs; the same count on the
  dynamic paged step through torch's ops is not 0, so the count can fail), nor does a
  dynamic one through the CPU's decode op;
- the buckets themselves, and the backend that cannot plan such a step, named.
"""

import pytest
import torch
from checkpoints import WINDOWED, random_model, tiny_config
from torch.overrides import TorchFunctionMode

import qinfer
from qinfer import kernels
from qinfer.attention.backend import choose_backend
from qinfer.attention.gathered import GatheredBackend
from qinfer.attention.paged import PagedBackend
from qinfer.core.errors import QinferError
from qinfer.core.features import Features
from qinfer.engine import LLM
from qinfer.engine.sequence import Sequence, scheduled_step
from qinfer.request.sampling import SamplingParams
from qinfer.runtime.config import RuntimeConfig
from qinfer.runtime.executor import Executor
from qinfer.runtime.static_decode import bucket

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = pytest.mark.slow

FAMILIES = {"llama": ("llama", {}), **WINDOWED}


def greedy_tokens(model, prompts, **engine_args) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(model, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, **engine_args)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().kv_blocks_used == 0
    return [out.token_ids for out in outputs]


@pytest.mark.parametrize("family", FAMILIES)
def test_bucketed_decode_gives_the_dynamic_paths_tokens(family):
    """Five prompts of 3 to 30 tokens run together (a bucket of 8 rows, then of fewer as
    they finish at different lengths; tables of 1 to 11 blocks of 4, in buckets of 1, 2, 4,
    8 and 16)."""
    name, overrides = FAMILIES[family]
    model = random_model(name, **overrides)
    lengths = [3, 30, 9, 17, 5]
    prompts = [[(7 * n + 3 * i) % 256 for i in range(n)] for n in lengths]
    dynamic = greedy_tokens(model, prompts)
    assert greedy_tokens(model, prompts, static_decode=True) == dynamic


FACTORIES = {
    "tensor",
    "as_tensor",
    "from_numpy",
    "arange",
    "empty",
    "zeros",
    "ones",
    "full",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "empty_strided",
    "linspace",
}
SYNCS = {"item", "tolist", "__bool__", "cpu", "numpy"}


class Made(TorchFunctionMode):
    """Counts the torch functions a step calls that make a tensor from nothing or from
    host data (an allocation a replayed CUDA graph cannot hold), and the reads back to
    the host."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in FACTORIES or name in SYNCS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def decode_steps(
    executor: Executor, size: int, seqs: list[Sequence], steps: int
) -> list[list[str]]:
    """Prefill `seqs` (blocks of `size`), then decode `steps` steps; the calls `Made`
    counted in each decode."""
    spaces = executor.spaces
    free = iter(range(min(executor.num_blocks)))

    def step(new: list[int]):
        for seq, n in zip(seqs, new, strict=True):
            while len(seq.tables[0]) * size < seq.num_computed_tokens + n:
                seq.tables[0].append(next(free))
            seq.tables[1:] = [list(seq.tables[0])]
        inputs = scheduled_step(seqs, new, [1] * len(seqs), spaces, size)
        with Made() as made:
            executor.execute(inputs)
        for seq, n in zip(seqs, new, strict=True):
            seq.num_computed_tokens += n
            seq.token_ids.append(5)
        return made.calls

    step([len(seq.token_ids) for seq in seqs])
    return [step([1] * len(seqs)) for _ in range(steps)]


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_a_bucketed_decode_step_makes_no_tensor(family, torch_ops_only):
    """Three sequences (a bucket of 4) whose tables stay in the bucket of 2 blocks of 16:
    after the bucket's first step, a step makes no tensor and reads nothing back. The
    dynamic paged step through torch's ops, which groups the sequences on the host, does
    both (so the count can fail); through the CPU's decode op it does neither either."""
    name, overrides = FAMILIES[family]
    model = random_model(name, **overrides)

    def counts(static: bool) -> list[list[str]]:
        config = RuntimeConfig(block_size=16, num_kv_blocks=16, static_decode=static)
        seqs = [Sequence(str(b), list(range(1, n + 1))) for b, n in enumerate([20, 17, 25])]
        return decode_steps(Executor(model, config), 16, seqs, steps=3)

    first, *seen = counts(True)
    assert seen == [[], []], seen
    if kernels.in_use():
        assert counts(False) == [[], [], []]
    with torch_ops_only():
        grouped = counts(False)
    assert all(calls for calls in grouped), grouped


def test_buckets_are_powers_of_two_up_to_the_capacity():
    assert [bucket(n, 32) for n in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16, 32, 32]
    assert bucket(20, 24) == 24 and bucket(30, 24) == 30  # capped, never below n


def test_static_decode_needs_a_backend_that_plans_it(torch_ops_only):
    """The paged backend plans static decode steps through the CPU's decode op alone: over
    fp32, bf16 and int8 K/V, not over an fp8 KV cache, nor for fp16 queries or K/V (the op
    takes fp32 and bf16 queries), nor on torch's ops; auto then takes the gathered
    backend."""
    cpu, plain = torch.device("cpu"), Features()
    if kernels.in_use():
        assert choose_backend("paged", cpu, plain, True, torch.float32, torch.int8).decode_kernel
    for dtypes in [(torch.float32, torch.float8_e4m3fn), (torch.float16, torch.float16)]:
        with pytest.raises(QinferError, match="'paged' plans static decode steps only"):
            choose_backend("paged", cpu, plain, True, *dtypes)
        assert isinstance(choose_backend("auto", cpu, plain, True, *dtypes), GatheredBackend)
        assert not choose_backend("paged", cpu, plain, False, *dtypes).decode_kernel
    with torch_ops_only():
        with pytest.raises(QinferError, match="'paged' plans static decode steps only"):
            LLM(random_model("qwen3"), static_decode=True, attention_backend="paged")
    llm = LLM(random_model("qwen3"), static_decode=True, num_kv_blocks=8)
    assert llm.engine.executor.num_blocks == [8]  # the scratch block is not counted
    paged = kernels.in_use()  # the CPU's decode op plans it
    assert isinstance(
        llm.engine.executor.runner.backend, PagedBackend if paged else GatheredBackend
    )


def test_an_fp16_model_decodes_on_the_cpu_bucketed_or_not():
    """fp16 queries and K/V, which the CPU's decode op does not take: the dynamic step
    attends through torch's ops, the bucketed one through the gathered backend, and both
    give the same greedy tokens."""
    model = qinfer.Transformer.random(tiny_config("qwen3"), dtype=torch.float16)
    prompts = [[(5 * n + i) % 256 for i in range(n)] for n in (3, 11)]
    assert greedy_tokens(model, prompts, static_decode=True) == greedy_tokens(model, prompts)

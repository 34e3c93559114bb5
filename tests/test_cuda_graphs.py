"""CUDA graphs of the bucketed decode step (`qinfer.runtime.cuda_graphs`), everything but
the capture: no GPU is at hand here, so a graph that records the step as a closure and
runs that same closure at each replay stands in for `torch.cuda.CUDAGraph`.

What that proves: a replay rebuilds nothing from the step it serves. The closure keeps
the tensors and host values of the step it was captured on, as a real graph keeps its
kernels' arguments; a step whose inputs were not all written into the step buffers (or
a plan that read a later step's host values) would decode another step's tokens, and the
greedy tokens would differ from the eager engine's.
"""

import functools

import pytest
import torch
from checkpoints import WINDOWED, random_model

from qinfer.core.errors import QinferError
from qinfer.engine import LLM
from qinfer.request.sampling import SamplingParams
from qinfer.runtime import cuda_graphs, runner


class RecordedGraph:
    """capture: run the step once and keep it; replay: run the kept step again, writing
    its output into the tensor capture returned (the graph's own output memory)."""

    def __init__(self) -> None:
        self.step = None
        self.output = None

    def capture(self, run):
        self.step, self.output = run, run()
        return self.output

    def replay(self) -> None:
        self.output.copy_(self.step())


@pytest.fixture
def recorded_graphs(monkeypatch):
    """Runners made in the test replay recorded graphs, as they would CUDA graphs on a GPU."""
    monkeypatch.setattr(runner, "use_cuda_graphs", lambda asked, device: bool(asked))
    monkeypatch.setattr(
        runner, "StepGraphs", functools.partial(cuda_graphs.StepGraphs, new_graph=RecordedGraph)
    )


def greedy(model, prompts, **engine_args):
    # each its own length, so that the batch shrinks through the buckets as they finish
    params = [
        SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    llm = LLM(model, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, **engine_args)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().kv_blocks_used == 0
    return [out.token_ids for out in outputs], llm.engine.executor.runner


@pytest.mark.parametrize("family", ["llama", "mistral-window", "qwen3-moe", "gemma3"])
def test_replayed_decode_gives_the_eager_engines_tokens(family, recorded_graphs):
    """Five prompts of 3 to 30 tokens decoding together, finishing one after another:
    buckets of 8, 4, 2 and 1 rows and of several table widths, each captured once and
    replayed for every decode step after."""
    name, overrides = {"llama": ("llama", {}), **WINDOWED}[family]
    model = random_model(name, **overrides)
    lengths = [3, 30, 9, 17, 5]
    prompts = [[(7 * n + 3 * i) % 256 for i in range(n)] for n in lengths]
    eager, _ = greedy(model, prompts)
    replayed, graphed = greedy(model, prompts, cuda_graphs=True)
    assert replayed == eager
    graphs = graphed.graphs
    assert graphed.static_decode
    assert {rows for rows, _ in graphs.graphs} == {8, 4, 2, 1}
    # every decode step replays; only a bucket's first step captures (and runs eagerly)
    assert graphs.replays > len(graphs.graphs)


def test_grown_step_buffers_drop_the_graphs(recorded_graphs):
    """Step buffers that grow are new memory: the graphs over the old ones are dropped and
    captured again, and the tokens stay the eager engine's (a kept graph would read the
    old buffers: the first step's inputs, every step)."""
    model = random_model("llama")
    prompts = [[(5 * i + 1) % 256 for i in range(n)] for n in (6, 11, 3, 8)]
    eager, _ = greedy(model, prompts)
    params = [
        SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(4)
    ]
    llm = LLM(model, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, cuda_graphs=True)
    first = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    graphed = llm.engine.executor.runner
    before = dict(graphed.graphs.graphs)
    tokens, seqs, blocks = graphed.buffers.capacity
    graphed.buffers._allocate(2 * tokens, 2 * seqs, tuple(2 * b for b in blocks))
    again = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert first == again == eager
    after = graphed.graphs.graphs
    assert set(after) == set(before) and all(after[k] is not before[k] for k in after)


def test_the_default_follows_the_device_and_cpu_refuses_in_one_line():
    assert cuda_graphs.use_cuda_graphs(None, torch.device("cpu")) is False
    assert cuda_graphs.use_cuda_graphs(None, torch.device("cuda")) is True
    assert cuda_graphs.use_cuda_graphs(False, torch.device("cuda")) is False
    with pytest.raises(
        QinferError, match="cuda_graphs needs a CUDA device; this model runs on cpu"
    ):
        LLM(random_model("llama"), cuda_graphs=True)


@pytest.mark.parametrize(
    "flags, expected", [([], None), (["--cuda-graphs"], True), (["--enforce-eager"], False)]
)
def test_serve_flags_set_cuda_graphs(flags, expected):
    from qinfer.cli import build_parser

    assert build_parser().parse_args(["serve", *flags]).cuda_graphs is expected

"""CUDA graphs of the bucketed decode step: captured once per bucket, then replayed.

A decode step on a GPU is launch-bound: SmolLM2's runs ~1,650 small kernels whose work
takes less time than launching them from Python. The static decode step
(`qinfer.runtime.static_decode`) makes every tensor of a bucket's step a view of the
runner's step buffers or an op's output over them, so one bucket's step is one fixed
sequence of kernels over fixed addresses: a graph captures it once and replays it for
the cost of one launch.

    step of bucket (Gb, Wb) seen first:  run it once eagerly (lazy initialisations: cached
                                         aranges, kernels' workspaces), then capture it
    every step of that bucket:           write its inputs into the step buffers, replay,
                                         read the logits from the graph's output

What a replay reads and writes: the step buffers (token ids, positions, slots, tables,
context lengths: written by `StepBuffers.write` before the replay, outside the graph),
the KV pools (written in place by the captured step) and the graph's own output (the
bucket's logits, copied out before the next replay overwrites them). A graph is keyed by
the bucket and the buffers' capacity: buffers that grow are new memory, and the graphs
of the old are dropped with it.

Only the capture itself needs a GPU; `Graph` is the seam the tests fill on a CPU with a
graph that records the step and runs it at each replay.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Protocol

import torch

from qinfer.core.errors import QinferError


def use_cuda_graphs(asked: bool | None, device: torch.device) -> bool:
    """Whether a runner on `device` replays CUDA graphs: as asked (`cuda_graphs`), by
    default on a CUDA device; asked for elsewhere, a one-line error."""
    if asked is None:
        return device.type == "cuda"
    if asked and device.type != "cuda":
        raise QinferError(
            f"cuda_graphs needs a CUDA device; this model runs on {device.type} "
            "(drop --cuda-graphs)"
        )
    return asked


class Graph(Protocol):
    """A captured computation: `capture(run)` records run() and returns its output,
    `replay()` runs it again over the same memory (the output rewritten in place)."""

    def capture(self, run: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class CudaGraph:
    """A `torch.cuda.CUDAGraph`, captured on a side stream into a memory pool shared by
    every bucket's graph (captured in turn, they reuse one another's activations)."""

    def __init__(self, pool: object) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            return run()

    def replay(self) -> None:
        self.graph.replay()


class StepGraphs:
    """One graph per bucket of the decode step (module docstring).

    new_graph: makes an empty `Graph` (default: a `CudaGraph` in one shared pool)."""

    def __init__(self, new_graph: Callable[[], Graph] | None = None) -> None:
        if new_graph is None:
            pool = torch.cuda.graph_pool_handle()
            new_graph = lambda: CudaGraph(pool)  # noqa: E731
        self.new_graph = new_graph
        self.graphs: dict[Hashable, tuple[Graph, torch.Tensor]] = {}
        self.replays = 0

    def run(self, key: Hashable, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The output of `step` (whose inputs are already written) for bucket `key`: the
        bucket's graph replayed, captured first (after one eager run) if it is new; a
        copy, so that the next replay cannot change it."""
        entry = self.graphs.get(key)
        if entry is None:
            step()  # eager first: what initialises itself lazily is not captured
            graph = self.new_graph()
            entry = self.graphs[key] = (graph, graph.capture(step))
        graph, output = entry
        graph.replay()
        self.replays += 1
        return output.clone()

    def clear(self) -> None:
        """Forget every graph (the step buffers they read were replaced)."""
        self.graphs.clear()

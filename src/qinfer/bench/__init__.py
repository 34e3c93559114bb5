"""Benchmarks: how fast qinfer runs, set against transformers on the same checkpoint.

model.py (`qinfer bench`): one model's prefill and decode speed, peak memory and weight
bandwidth. engine.py (`qinfer bench --batch`, bench/bench_engine.py): the batching engine's
throughput on a mixed workload, against one-by-one generation. speculative.py (`qinfer
bench --speculative-method ...`): decode speed with and without speculative decoding.
common.py: the timer and the transformers loader both use. linear_paths.py: what each
path of each quantized shape costs, beside the path `qinfer.linear.choose` gave it.
greedy.py: where greedy decoding leaves a reference's path, and at what near-tie. The
library itself imports none of this.
"""

from qinfer.bench.engine import Workload, format_engine_report, run_engine_benchmark
from qinfer.bench.model import BenchSettings, format_report, run_benchmarks

__all__ = [
    "BenchSettings",
    "Workload",
    "format_engine_report",
    "format_report",
    "run_benchmarks",
    "run_engine_benchmark",
]

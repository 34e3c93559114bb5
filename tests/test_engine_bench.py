"""The engine benchmark runs each way of serving its workload and reports their figures."""

from checkpoints import build_checkpoint

from qinfer.bench import Workload, format_engine_report, run_engine_benchmark


def test_benchmark_reports_each_way_and_the_ratios(tmp_path):
    build_checkpoint(tmp_path, "llama")
    workload = Workload(4, 2, 6, 1, 3, seed=1)
    load_args = {"dtype": "float32", "device": "cpu"}
    report = run_engine_benchmark(
        str(tmp_path), load_args, workload, compare_hf=True, max_num_seqs=2
    )
    _, lengths = workload.draw(256)
    assert report["output_tokens"] == sum(lengths)
    for way in ("engine", "one_by_one", "transformers"):
        assert report[way]["seconds"] > 0
    assert report["engine_over_one_by_one"] > 0 and report["engine_over_transformers"] > 0
    assert "engine / transformers" in format_engine_report(report)

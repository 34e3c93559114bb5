"""What `GET /metrics` reports, in the Prometheus text format.

Two sources: the server counts requests and times them (latency histograms), and the
engine's `stats()` is read at each scrape for what only it knows (queue lengths, KV block
use, prefix-cache hits, token totals). The gauges routers scrape also go out under vLLM's
names (`VLLM_GAUGES`, labelled with the served model's name as vLLM labels them), so that
a router made for vLLM (llm-d's scheduler) reads a qinfer replica as it reads vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from qinfer.request.grammar import live_matchers

if TYPE_CHECKING:
    from qinfer.engine import EngineStats


#: Histogram buckets in seconds: from a fast CPU decode step to a long queued request.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


#: vLLM's name of each qinfer gauge it also has.
VLLM_GAUGES = {
    "qinfer_requests_running": "vllm:num_requests_running",
    "qinfer_requests_waiting": "vllm:num_requests_waiting",
    "qinfer_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",  # a fraction, despite "perc"
}


class EngineCollector(Collector):
    """Reads the engine's counters and gauges afresh at every scrape."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str):
        self.stats, self.model_name = stats, model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.stats()
        gauges = {
            "qinfer_requests_running": ("Requests being generated now", s.num_running),
            "qinfer_requests_waiting": ("Requests queued for a slot", s.num_waiting),
            "qinfer_kv_blocks_total": ("KV cache blocks in the pool", s.kv_blocks_total),
            "qinfer_kv_blocks_used": ("KV cache blocks held by requests", s.kv_blocks_used),
            "qinfer_kv_blocks_cached": (
                "Free KV blocks holding reusable prefixes",
                s.kv_blocks_cached,
            ),
            "qinfer_kv_cache_usage_ratio": (
                "Fraction of KV blocks held by requests",
                s.kv_blocks_used / max(s.kv_blocks_total, 1),
            ),
            "qinfer_generation_tokens_per_second": (
                "Generated tokens per second over the last seconds",
                s.generation_tokens_per_s,
            ),
            "qinfer_prefix_cache_hit_rate": (
                "Prompt tokens found in the prefix cache, as a fraction of those looked up",
                s.prefix_cache_hit_rate,
            ),
            "qinfer_spec_decode_mean_accepted_length": (
                "Tokens per speculative verification: accepted proposals plus one sampled",
                s.spec_mean_accepted_length,
            ),
            "qinfer_grammar_matchers_live": (
                "Grammar matchers of constrained requests alive in this process",
                live_matchers(),
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
            if name in VLLM_GAUGES:
                gauge = GaugeMetricFamily(
                    VLLM_GAUGES[name], f"{doc} (vLLM's name)", labels=["model_name"]
                )
                gauge.add_metric([self.model_name], value)
                yield gauge
        counters = {
            "qinfer_prompt_tokens": ("Prompt tokens processed", s.prompt_tokens_total),
            "qinfer_generation_tokens": ("Tokens generated", s.generation_tokens_total),
            "qinfer_prompt_tokens_computed": (
                "Prompt tokens run through the model (recomputations too)",
                s.prompt_tokens_computed_total,
            ),
            "qinfer_prompt_tokens_from_disk": (
                "Prompt tokens whose K/V were read from the prompt cache on disk",
                s.prompt_tokens_from_disk_total,
            ),
            "qinfer_prefix_cache_queries": (
                "Prompt tokens looked up in the prefix cache",
                s.prefix_cache_queries,
            ),
            "qinfer_prefix_cache_hits": (
                "Prompt tokens found in the prefix cache",
                s.prefix_cache_hits,
            ),
            "qinfer_preemptions": ("Requests preempted to free KV blocks", s.preemptions_total),
            "qinfer_requests_finished": ("Requests the engine finished", s.requests_finished_total),
            "qinfer_requests_aborted": (
                "Requests aborted (client gone, or a reply over: a tool call repeated)",
                s.requests_aborted_total,
            ),
            "qinfer_spec_decode_verifications": (
                "Sequence steps that verified proposed tokens",
                s.spec_verifications_total,
            ),
            "qinfer_spec_decode_proposed_tokens": (
                "Tokens proposed by speculative decoding",
                s.spec_proposed_tokens_total,
            ),
            "qinfer_spec_decode_accepted_tokens": (
                "Proposed tokens the model accepted",
                s.spec_accepted_tokens_total,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """The server's own counters and latency histograms, plus the engine's view."""

    def __init__(self, engine_stats: Callable[[], EngineStats], model_name: str):
        # A registry per server, not the process-wide default: two apps in one process
        # (as in the tests) must not share or clash over metric names.
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "qinfer_http_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.time_to_first_token = self._latency_histogram(
            "qinfer_time_to_first_token_seconds",
            "From handing a request to the engine (queueing included) to its first token",
        )
        self.inter_token_latency = self._latency_histogram(
            "qinfer_inter_token_latency_seconds",
            "Between consecutive generated tokens of one request",
        )
        self.request_latency = self._latency_histogram(
            "qinfer_request_latency_seconds",
            "From handing a request to the engine to its last token",
        )
        self.registry.register(EngineCollector(engine_stats, model_name))

    def _latency_histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class RequestTimer:
    """Feeds one generation's token timings into the latency histograms."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.tokens = 0

    def tokens_arrived(self, count: int) -> None:
        """`count` new tokens arrived together (one engine output)."""
        if count <= 0:
            return
        now = time.perf_counter()
        if self.tokens == 0:
            self.metrics.time_to_first_token.observe(now - self.start)
        else:
            # Several tokens in one output share the gap since the previous output.
            gap = (now - self.last) / count
            for _ in range(count):
                self.metrics.inter_token_latency.observe(gap)
        self.tokens += count
        self.last = now

    def finished(self) -> None:
        self.metrics.request_latency.observe(time.perf_counter() - self.start)

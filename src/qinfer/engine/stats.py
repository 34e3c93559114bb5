"""How the engine is doing: queue lengths, KV blocks, prefix-cache hits, throughput."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

#: Generation throughput is measured over the last this many seconds.
THROUGHPUT_WINDOW_S = 10.0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine (the server exposes these as Prometheus metrics)."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int  # free blocks still holding reusable prefix K/V
    kv_block_size: int  # token positions per block (blocks x this: tokens)
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found there
    prefix_cache_hit_rate: float  # hits / queries (0 before any query)
    prompt_tokens_total: int  # prompt tokens of the requests added
    prompt_tokens_computed_total: int  # prompt tokens run through the model (recomputes too)
    # prompt tokens whose K/V were read from the prefix cache's disk tier, not computed
    prompt_tokens_from_disk_total: int
    generation_tokens_total: int
    requests_finished_total: int
    requests_aborted_total: int
    preemptions_total: int
    generation_tokens_per_s: float
    # images through the vision tower (re-encodes after a preemption too), and its seconds
    images_encoded_total: int = 0
    vision_encoder_seconds_total: float = 0.0
    # speculative decoding (0 when off): steps of a sequence that verified proposals,
    # tokens proposed, tokens of those accepted
    spec_verifications_total: int = 0
    spec_proposed_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed tokens (0 before any proposal)."""
        return self.spec_accepted_tokens_total / max(self.spec_proposed_tokens_total, 1)

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verifying step yields on average: the accepted proposals plus the one
        the model samples itself (1 before any verification)."""
        return 1 + self.spec_accepted_tokens_total / max(self.spec_verifications_total, 1)


class ThroughputMeter:
    """Tokens per second over a sliding time window."""

    def __init__(self, window_s: float = THROUGHPUT_WINDOW_S) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()  # (time, tokens)

    def add(self, tokens: int, now: float | None = None) -> None:
        self._events.append((time.monotonic() if now is None else now, tokens))

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
        if not self._events:
            return 0.0
        elapsed = max(now - self._events[0][0], 1e-3)
        return sum(tokens for _, tokens in self._events) / elapsed

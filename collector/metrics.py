"""Prometheus metrics of the collecting loop, created on a registry passed in (never global)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
WAIT_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 20, 40, 80)
TOKEN_BUCKETS = (64, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)
DROP_REASONS = ("stale", "side", "empty", "invalid", "duplicate")


class CollectorMetrics:
    """Turns in and dropped, staleness, rewards per version, batches and their wait time."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.turns = Counter("liveloop_collector_turns", "Scored turns read.", registry=r)
        self.dropped = Counter(
            "liveloop_collector_dropped_turns",
            "Turns not batched, by reason (stale, side, empty, invalid, duplicate).",
            ["reason"],
            registry=r,
        )
        for reason in DROP_REASONS:  # exported at 0 from the start (rate() shows 0, not no data)
            self.dropped.labels(reason)
        self.staleness = self._histogram(
            "staleness",
            "Versions between a turn's oldest token and the trainer when the turn was read.",
            STALENESS_BUCKETS,
        )
        self.reward = Summary(
            "liveloop_collector_reward",
            "Judged score of turns, by the policy version that produced most of their tokens.",
            ["version"],
            registry=r,
        )
        self.batches = Counter("liveloop_collector_batches", "Batches published.", registry=r)
        self.batched_turns = Counter(
            "liveloop_collector_batched_turns", "Turns published in batches.", registry=r
        )
        self.hinted_turns = Counter(
            "liveloop_collector_hinted_turns",
            "Turns published in batches with a directive hint (for on-policy distillation).",
            registry=r,
        )
        self.batch_tokens = self._histogram(
            "batch_tokens", "Tokens per published batch.", TOKEN_BUCKETS
        )
        self.by_reference = Counter(
            "liveloop_collector_batches_by_reference",
            "Batches written to a file instead of inline.",
            registry=r,
        )
        self.batch_wait = self._histogram(
            "batch_wait_seconds",
            "Time from a batch's oldest turn arriving to the batch being published.",
            WAIT_BUCKETS,
        )
        self.pending = Gauge(
            "liveloop_collector_pending_turns",
            "Turns waiting in groups or for a batch.",
            registry=r,
        )
        self.queued_batches = Gauge(
            "liveloop_collector_queued_batches",
            "Published batches the trainer has not read yet, as last seen before publishing.",
            registry=r,
        )
        self.trainer_version = Gauge(
            "liveloop_collector_trainer_version",
            "Trainer version staleness is bounded against.",
            registry=r,
        )
        self.baseline = Gauge(
            "liveloop_collector_baseline",
            "Running reward baseline per judge.",
            ["judge"],
            registry=r,
        )

        self.credited_calls = Counter(
            "liveloop_collector_credited_calls",
            "Tool-call turns released for training: 'answered' (credited with the judgment "
            "of the answer they led to) or 'expired' (no judged answer in time).",
            ["outcome"],
            registry=r,
        )
        self.waiting_calls = Gauge(
            "liveloop_collector_waiting_calls",
            "Tool-call turns waiting for the judgment of their answer.",
            registry=r,
        )

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(f"liveloop_collector_{name}", doc, buckets=buckets, registry=self.registry)

"""Prometheus metrics of the torch engine's LoRA adapters (in-process or in a worker).

The decode thread reports adapter events (`adapters.AdapterEvents`: an event name and a
value); `AdapterMetrics.observe` turns them into metrics. With the engine in a worker
process the events cross the socket and are observed by `EngineProcess` here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class AdapterMetrics:
    """`liveloop_adapter_*`: reload waits, reloads and evictions of in-memory adapters."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.reload_wait = Histogram(
            "liveloop_adapter_reload_wait_seconds",
            "Time a request waited for its adapter, evicted from memory, to be read back "
            "from its checkpoint before its prompt could start.",
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.reloads = Counter(
            "liveloop_adapter_reloads",
            "Evicted adapters read back from their checkpoint, by outcome (ok, failed).",
            ["outcome"],
            registry=registry,
        )
        for outcome in ("ok", "failed"):
            self.reloads.labels(outcome)
        self.evictions = Counter(
            "liveloop_adapter_evictions",
            "Adapters evicted from memory to make room for another (least recently used).",
            registry=registry,
        )

    def observe(self, event: str, value: float) -> None:
        """Record one adapter event of the decode loop."""
        if event == "reload_wait":
            self.reload_wait.observe(value)
        elif event == "reload":
            self.reloads.labels("ok").inc(value)
        elif event == "reload_failed":
            self.reloads.labels("failed").inc(value)
        elif event == "eviction":
            self.evictions.inc(value)

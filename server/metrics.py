"""Prometheus metrics of the serving loop, all named `liveloop_*`.

Created on a `CollectorRegistry` handed in by the app factory (never at import), so tests
and several apps in one process do not collide. Gauges that mirror live state (running and
queued requests, policy version) read it on scrape through callbacks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from liveloop.labels import TopLabels

ADAPTER_LABELS = 10  # adapters named in metrics; the rest count as 'other'

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


class ServerMetrics:
    """Latency histograms, token counters, load gauges and error counts of one server."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.ttft = Histogram(
            "liveloop_time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token = Histogram(
            "liveloop_inter_token_latency_seconds",
            "Time between two consecutive tokens of one sample.",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "liveloop_e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "liveloop_prompt_tokens", "Prompt tokens processed.", registry=registry
        )
        self.completion_tokens = Counter(
            "liveloop_completion_tokens", "Completion tokens generated.", registry=registry
        )
        self._counters(registry)
        self._gauges(registry)

    def _counters(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "liveloop_requests",
            "Finished chat samples by finish reason.",
            ["finish_reason"],
            registry=registry,
        )
        self.prompt_mode = Counter(
            "liveloop_prompt_mode",
            "Prompts built fresh vs extended token-exactly from the previous turn.",
            ["mode"],
            registry=registry,
        )
        self.errors = Counter(
            "liveloop_errors", "Error responses by type.", ["type"], registry=registry
        )
        self.adapter_requests = Counter(
            "liveloop_adapter_requests",
            "Chat requests by the LoRA adapter they ran on ('base': none; the busiest "
            f"{ADAPTER_LABELS} adapters by name, the rest as 'other').",
            ["adapter"],
            registry=registry,
        )
        self.adapter_labels = TopLabels(ADAPTER_LABELS, self._drop_adapter)

    def _drop_adapter(self, name: str) -> None:
        with contextlib.suppress(KeyError):
            self.adapter_requests.remove(name)

    def count_adapter_request(self, adapter: str | None) -> None:
        """One request on `adapter` (None: the base), under a bounded label."""
        self.adapter_requests.labels(
            "base" if adapter is None else self.adapter_labels.label(adapter)
        ).inc()

    def _gauges(self, registry: CollectorRegistry) -> None:
        self.running = Gauge(
            "liveloop_requests_running", "Sequences being decoded.", registry=registry
        )
        self.queued = Gauge(
            "liveloop_requests_queued", "Sequences waiting for a slot.", registry=registry
        )
        self.policy_version = Gauge(
            "liveloop_policy_version", "Policy version being served.", registry=registry
        )
        self.capture = Gauge(
            "liveloop_trace_capture_enabled", "1 while turns are recorded.", registry=registry
        )
        self.connections_closed = Counter(
            "liveloop_http_connections_closed",
            "Connections the server closed on a limit: read_timeout (request not received "
            "in time), header_too_large, write_stall (the client stopped reading).",
            ["reason"],
            registry=registry,
        )
        for reason in ("read_timeout", "header_too_large", "write_stall"):
            self.connections_closed.labels(reason)
        self.limited = Counter(
            "liveloop_requests_limited",
            "Requests refused with 429 by a key's limits: rate or concurrency.",
            ["reason"],
            registry=registry,
        )
        for reason in ("rate", "concurrency"):
            self.limited.labels(reason)

    def bind(
        self,
        running: Callable[[], float],
        queued: Callable[[], float],
        version: Callable[[], float],
        capture: Callable[[], float],
    ) -> None:
        """Read the live gauges from these callbacks on every scrape."""
        self.running.set_function(running)
        self.queued.set_function(queued)
        self.policy_version.set_function(version)
        self.capture.set_function(capture)

    def error(self, kind: str) -> None:
        """Count an error response."""
        self.errors.labels(type=kind).inc()

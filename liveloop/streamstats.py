"""Prometheus exporter of the stream bus's own state: lengths, consumer groups, dead letters.

The loops count what they do; only Redis knows how far behind a consumer group is. This
collector asks it on every scrape (a handful of O(1) commands per stream: XLEN, XINFO
GROUPS and one XRANGE per group) and exports, per stream of the pipeline:

- `liveloop_stream_length{stream}` and `liveloop_stream_dead_letters{stream}` (the length
  of the `:dlq` twin);
- per consumer group: `liveloop_stream_group_lag{stream,group}` (entries not yet delivered
  to the group), `..._lag_seconds` (age of the oldest of them), `..._pending` (delivered,
  not yet acknowledged) and `..._consumers`;
- `liveloop_bus_up`: 1 when Redis answered the scrape, 0 otherwise (the rest is then absent).

Any loop can register it on its metrics registry; `liveloop collect` does. With several
replicas each exports the same values, so dashboards aggregate with `max by (stream, group)`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import redis
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from liveloop import bus

log = logging.getLogger(__name__)

PIPELINE_STREAMS = (bus.TURNS, bus.FEEDBACK, bus.SCORED, bus.BATCHES, bus.WEIGHTS)
GROUP_LABELS = ("stream", "group")


def entry_time(entry_id: str) -> float:
    """Unix time (s) at which a stream entry id was created (its millisecond part)."""
    return int(entry_id.split("-", 1)[0]) / 1000.0


class StreamStateCollector(Collector):
    """Reads stream and consumer-group state from Redis on each scrape (a custom collector)."""

    def __init__(
        self,
        redis_url: str,
        streams: Sequence[str] = PIPELINE_STREAMS,
        *,
        timeout_s: float = 2.0,
    ) -> None:
        self.redis_url = redis_url
        self.streams = tuple(streams)
        self.timeout_s = timeout_s
        self._client: redis.Redis | None = None

    def _redis(self) -> redis.Redis:
        if self._client is None:
            self._client = redis.from_url(
                self.redis_url,
                decode_responses=True,
                socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s,
            )
        return self._client

    def describe(self) -> Iterable[Metric]:
        """Nothing: the families are read live (keeps registration free of Redis calls)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """One scrape: the families below, or only `liveloop_bus_up 0` if Redis fails."""
        up = GaugeMetricFamily("liveloop_bus_up", "1 when Redis answered this scrape.")
        try:
            families = self._read()
        except (redis.RedisError, OSError) as exc:
            log.debug("stream state scrape failed: %s", exc)
            up.add_metric([], 0.0)
            yield up
            return
        up.add_metric([], 1.0)
        yield up
        yield from families

    def _read(self) -> list[Metric]:
        client = self._redis()
        with client.pipeline(transaction=False) as pipe:
            for name in self.streams:
                pipe.xlen(bus.stream_key(name))
                pipe.xlen(bus.dlq_key(name))
            lengths: list[Any] = pipe.execute()
        length = GaugeMetricFamily(
            "liveloop_stream_length", "Entries in a stream.", labels=["stream"]
        )
        dead = GaugeMetricFamily(
            "liveloop_stream_dead_letters",
            "Entries in a stream's dead-letter twin (<stream>:dlq).",
            labels=["stream"],
        )
        groups = _GroupFamilies()
        now = time.time()
        for i, name in enumerate(self.streams):
            length.add_metric([name], float(lengths[2 * i]))
            dead.add_metric([name], float(lengths[2 * i + 1]))
            if lengths[2 * i]:
                self._read_groups(client, name, groups, now)
        return [length, dead, *groups.families()]

    def _read_groups(self, client: redis.Redis, name: str, out: _GroupFamilies, now: float) -> None:
        key = bus.stream_key(name)
        try:
            infos: Any = client.xinfo_groups(key)
        except redis.ResponseError:  # deleted between XLEN and XINFO
            return
        for info in infos:
            group = str(info["name"])
            lag = info.get("lag")
            pending = int(info.get("pending") or 0)
            oldest: Any = client.xrange(key, min=f"({info['last-delivered-id']}", count=1)
            age = max(0.0, now - entry_time(str(oldest[0][0]))) if oldest else 0.0
            consumers = int(info.get("consumers") or 0)
            # Redis reports no lag when entries were deleted mid-range: then none is exported.
            lag_entries = None if lag is None else int(lag)
            out.add(name, group, lag=lag_entries, age=age, pending=pending, consumers=consumers)


class _GroupFamilies:
    """The four per-group gauge families of one scrape."""

    def __init__(self) -> None:
        self.lag = GaugeMetricFamily(
            "liveloop_stream_group_lag",
            "Entries of a stream not yet delivered to a consumer group.",
            labels=GROUP_LABELS,
        )
        self.lag_seconds = GaugeMetricFamily(
            "liveloop_stream_group_lag_seconds",
            "Age of the oldest entry not yet delivered to a consumer group (0 when none).",
            labels=GROUP_LABELS,
        )
        self.pending = GaugeMetricFamily(
            "liveloop_stream_group_pending",
            "Entries delivered to a consumer group but not yet acknowledged.",
            labels=GROUP_LABELS,
        )
        self.consumers = GaugeMetricFamily(
            "liveloop_stream_group_consumers",
            "Consumers registered in a consumer group.",
            labels=GROUP_LABELS,
        )

    def add(
        self, stream: str, group: str, *, lag: int | None, age: float, pending: int, consumers: int
    ) -> None:
        """One group's samples."""
        labels = [stream, group]
        if lag is not None:
            self.lag.add_metric(labels, float(lag))
        self.lag_seconds.add_metric(labels, age)
        self.pending.add_metric(labels, float(pending))
        self.consumers.add_metric(labels, float(consumers))

    def families(self) -> list[Metric]:
        """The four families, for the scrape."""
        return [self.lag, self.lag_seconds, self.pending, self.consumers]

"""The exporter of stream state and the probes of the loops without an HTTP API, on real Valkey."""

from __future__ import annotations

import time

import httpx
import pytest
import redis
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from liveloop.health import LoopHealth
from liveloop.streamstats import StreamStateCollector, entry_time
from liveloop.valkey import free_port


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a registry's exposition, keyed by (name, sorted labels)."""
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_stream_state_reports_length_lag_pending_and_dead_letters(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    for i in range(5):
        client.xadd("liveloop:turns", {"data": str(i)})
    client.xgroup_create("liveloop:turns", "prm", id="0")
    client.xgroup_create("liveloop:turns", "audit", id="$")
    client.xadd("liveloop:turns", {"data": "late"})
    client.xreadgroup("prm", "c1", {"liveloop:turns": ">"}, count=2)  # 2 delivered, none acked
    client.xadd("liveloop:scored:dlq", {"data": "bad"})
    registry = CollectorRegistry()
    registry.register(StreamStateCollector(redis_url))

    got = samples(registry)

    def group(name: str, grp: str) -> float:
        return got[(name, (("group", grp), ("stream", "turns")))]

    assert got[("liveloop_bus_up", ())] == 1.0
    assert got[("liveloop_stream_length", (("stream", "turns"),))] == 6
    assert got[("liveloop_stream_length", (("stream", "batches"),))] == 0
    assert got[("liveloop_stream_dead_letters", (("stream", "scored"),))] == 1
    assert got[("liveloop_stream_dead_letters", (("stream", "turns"),))] == 0
    assert group("liveloop_stream_group_lag", "prm") == 4
    assert group("liveloop_stream_group_pending", "prm") == 2
    assert group("liveloop_stream_group_consumers", "prm") == 1
    # A group created at `$` has no read counter: Redis cannot tell its lag, so none is
    # exported, but the age of its oldest undelivered entry still is.
    assert ("liveloop_stream_group_lag", (("group", "audit"), ("stream", "turns"))) not in got
    assert 0 <= group("liveloop_stream_group_lag_seconds", "audit") < 60
    assert group("liveloop_stream_group_pending", "audit") == 0
    assert 0 <= group("liveloop_stream_group_lag_seconds", "prm") < 60

    client.xreadgroup("prm", "c1", {"liveloop:turns": ">"})
    client.xreadgroup("audit", "c1", {"liveloop:turns": ">"})
    got = samples(registry)
    assert group("liveloop_stream_group_lag", "prm") == 0
    assert group("liveloop_stream_group_lag_seconds", "prm") == 0
    assert group("liveloop_stream_group_pending", "prm") == 6
    client.close()


def test_stream_state_says_when_redis_is_gone() -> None:
    registry = CollectorRegistry()
    registry.register(StreamStateCollector(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5))
    got = samples(registry)
    assert got == {("liveloop_bus_up", ()): 0.0}


def test_entry_time_is_the_ids_millisecond_part() -> None:
    assert entry_time("1700000000123-7") == pytest.approx(1_700_000_000.123)


def test_probes_answer_health_readiness_and_metrics(redis_url: str) -> None:
    registry = CollectorRegistry()
    health = LoopHealth(registry, redis_url).start(free_port(), "127.0.0.1")
    assert health._server is not None
    base = f"http://127.0.0.1:{health._server.server_port}"
    try:
        assert httpx.get(base + "/healthz").status_code == 200
        starting = httpx.get(base + "/readyz")
        assert starting.status_code == 503 and starting.json() == {"status": "starting"}
        health.mark_ready()
        assert httpx.get(base + "/readyz").status_code == 200
        registry_gauge = Gauge("probe_test_value", "A value to find.", registry=registry)
        registry_gauge.set(7)
        scraped = httpx.get(base + "/metrics")
        assert scraped.headers["content-type"].startswith("text/plain")
        assert "probe_test_value 7.0" in scraped.text
        health.mark_stopping()
        assert httpx.get(base + "/readyz").status_code == 503
    finally:
        health.stop()


def test_readiness_fails_while_redis_is_unreachable() -> None:
    health = LoopHealth(CollectorRegistry(), f"redis://127.0.0.1:{free_port()}/0")
    health.mark_ready()
    started = time.monotonic()
    ready, reason = health.readiness()
    assert not ready and reason.startswith("redis unreachable")
    assert time.monotonic() - started < 5

"""TraceWriter against a real Valkey: direct writes, spooling while Redis is away, replay."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from liveloop import bus
from liveloop.contracts import TurnRecord
from liveloop.server.traces import TraceWriter
from liveloop.valkey import EmbeddedValkey, free_port
from tests.conftest import wait_for


def fast_writer(url: str, spool_dir: Path, registry: CollectorRegistry) -> TraceWriter:
    """A writer that probes Redis often, so that recovery shows within a test."""
    return TraceWriter(
        url, spool_dir, registry, probe_initial_s=0.05, probe_max_s=0.2, socket_timeout_s=1.0
    )


def make_turn(i: int, session: str = "sess") -> TurnRecord:
    return TurnRecord(
        session_id=session,
        turn_index=i,
        tenant="t1",
        request_id=f"req-{i}",
        messages=[{"role": "user", "content": f"hello {i}"}],
        prompt_token_ids=[1, 2, 3, i],
        completion_token_ids=[7, 8, i],
        logprobs=[-0.5, -0.25, -1.0],
        versions=[0, 0, 1],
        finish_reason="stop",
        model="tiny-random",
        created_at=1_700_000_000.0 + i,
    )


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def stream_turns(url: str) -> list[TurnRecord]:
    client = aredis.from_url(url, decode_responses=True)
    try:
        entries: Any = await client.xrange(bus.stream_key(bus.TURNS))
    finally:
        await client.aclose()
    return [bus.decode(fields, TurnRecord) for _id, fields in entries]


def spool_lines(spool_dir: Path) -> list[str]:
    lines: list[str] = []
    for path in sorted(spool_dir.glob("turns*.spool")):
        lines += path.read_text().splitlines()
    return lines


@pytest.fixture
def dead_url() -> str:
    """A Redis URL on a port nobody listens on (a Valkey may be started there later)."""
    return f"redis://127.0.0.1:{free_port()}/0"


@pytest.fixture
def own_valkey(tmp_path: Path) -> Iterator[EmbeddedValkey]:
    """A Valkey of this test only, that the test may stop and restart on the same port."""
    server = EmbeddedValkey(tmp_path / "own-valkey").start()
    yield server
    server.stop()


async def test_records_written_once_and_readable_with_xrange(
    redis_url: str, aredis_client: aredis.Redis, data_dir: Path
) -> None:
    registry = CollectorRegistry()
    writer = TraceWriter(redis_url, data_dir / "spool", registry)
    writer.submit(make_turn(0))  # before start: kept in memory, written once started
    await writer.start()
    for i in range(1, 5):
        writer.submit(make_turn(i))
    writer.submit(make_turn(2))  # a replayed record: same key, written once
    await wait_for(lambda: sample(registry, "liveloop_trace_records_total", outcome="written") == 6)
    await writer.stop()

    entries: Any = await aredis_client.xrange("liveloop:turns")
    assert len(entries) == 5
    turns = [bus.decode(fields, TurnRecord) for _id, fields in entries]
    assert turns == [make_turn(i) for i in range(5)]
    first = entries[0][1]
    assert (first["session_id"], first["turn_index"], first["turn_type"]) == ("sess", "0", "main")
    assert json.loads(first["data"])["completion_token_ids"] == [7, 8, 0]
    assert sample(registry, "liveloop_trace_write_seconds_count") == 6
    assert sample(registry, "liveloop_trace_records_total", outcome="spooled") == 0
    assert writer.spool_backlog == 0
    assert spool_lines(data_dir / "spool") == []


async def test_redis_down_spools_without_blocking_then_replays_in_order(
    dead_url: str, data_dir: Path, tmp_path: Path
) -> None:
    registry = CollectorRegistry()
    spool_dir = data_dir / "spool"
    writer = fast_writer(dead_url, spool_dir, registry)
    await writer.start()
    n = 20
    slowest = 0.0
    for i in range(n):
        started = time.perf_counter()
        writer.submit(make_turn(i))
        slowest = max(slowest, time.perf_counter() - started)
    assert slowest < 0.005  # submit never waits for Redis or the disk

    await wait_for(lambda: writer.spool_backlog == n)
    lines = spool_lines(spool_dir)
    assert [TurnRecord.model_validate_json(line) for line in lines] == [
        make_turn(i) for i in range(n)
    ]
    assert sample(registry, "liveloop_trace_spool_backlog") == n
    assert sample(registry, "liveloop_trace_records_total", outcome="spooled") == n

    port = int(dead_url.rsplit(":", 1)[1].split("/")[0])
    with EmbeddedValkey(tmp_path / "late-valkey", port=port):
        for i in range(n, n + 5):  # arrive while the backlog drains: must stay behind it
            writer.submit(make_turn(i))
        await wait_for(lambda: writer.spool_backlog == 0 and writer.queued == 0)
        await writer.stop()
        turns = await stream_turns(dead_url)
    assert [t.turn_index for t in turns] == list(range(n + 5))
    assert sample(registry, "liveloop_trace_records_total", outcome="replayed") >= n
    assert sample(registry, "liveloop_trace_spool_backlog") == 0
    assert spool_lines(spool_dir) == []


async def test_stop_flushes_queue_to_spool_and_restart_replays_leftover(
    dead_url: str, redis_url: str, data_dir: Path
) -> None:
    spool_dir = data_dir / "spool"
    first = fast_writer(dead_url, spool_dir, CollectorRegistry())
    await first.start()
    for i in range(8):
        first.submit(make_turn(i))
    await first.stop()  # no waiting: stop itself must flush the queue
    assert len(spool_lines(spool_dir)) == 8
    first.submit(make_turn(8))  # after stop: still spooled, never dropped
    assert len(spool_lines(spool_dir)) == 9
    with open(spool_dir / "turns.spool", "a") as fh:
        fh.write('{"session_id": "torn')  # a crash mid-append: never fsynced

    registry = CollectorRegistry()
    second = fast_writer(redis_url, spool_dir, registry)
    await second.start()
    assert second.spool_backlog == 10  # 9 records and the torn line, read back as a line
    assert sample(registry, "liveloop_trace_spool_torn_tails_total") == 1
    await wait_for(lambda: second.spool_backlog == 0)
    await second.stop()
    assert [t.turn_index for t in await stream_turns(redis_url)] == list(range(9))
    assert sample(registry, "liveloop_trace_records_total", outcome="replayed") == 9
    assert sample(registry, "liveloop_trace_records_total", outcome="quarantined") == 1
    assert (spool_dir / "turns.bad").read_text().splitlines()[1] == '{"session_id": "torn'
    assert spool_lines(spool_dir) == []


async def test_replaying_the_same_spool_twice_writes_each_record_once(
    dead_url: str, redis_url: str, data_dir: Path, tmp_path: Path
) -> None:
    spool_dir = data_dir / "spool"
    down = fast_writer(dead_url, spool_dir, CollectorRegistry())
    await down.start()
    for i in range(12):
        down.submit(make_turn(i))
    await down.stop()
    saved = tmp_path / "turns.spool.copy"
    shutil.copy(spool_dir / "turns.spool", saved)  # the state a crash before truncation leaves

    for _attempt in range(2):
        writer = fast_writer(redis_url, spool_dir, CollectorRegistry())
        await writer.start()
        await wait_for(lambda w=writer: w.spool_backlog == 0)  # type: ignore[misc]
        await writer.stop()
        shutil.copy(saved, spool_dir / "turns.spool")
    assert [t.turn_index for t in await stream_turns(redis_url)] == list(range(12))


async def test_redis_restart_mid_run_loses_and_duplicates_nothing(
    own_valkey: EmbeddedValkey, data_dir: Path
) -> None:
    registry = CollectorRegistry()
    writer = fast_writer(own_valkey.url, data_dir / "spool", registry)
    await writer.start()
    for i in range(5):
        writer.submit(make_turn(i))
    await wait_for(lambda: sample(registry, "liveloop_trace_records_total", outcome="written") == 5)
    own_valkey.stop()  # keeps its data (AOF)
    for i in range(5, 10):
        writer.submit(make_turn(i))
    await wait_for(lambda: writer.spool_backlog == 5)
    own_valkey.start()
    await wait_for(lambda: writer.spool_backlog == 0)
    for i in range(10, 12):
        writer.submit(make_turn(i))
    await writer.stop()
    assert [t.turn_index for t in await stream_turns(own_valkey.url)] == list(range(12))
    assert sample(registry, "liveloop_trace_records_total", outcome="replayed") == 5
    assert sample(registry, "liveloop_trace_records_total", outcome="dropped") == 0


async def test_two_writers_on_one_spool_dir_keep_separate_files(
    dead_url: str, redis_url: str, data_dir: Path
) -> None:
    spool_dir = data_dir / "spool"
    a = fast_writer(dead_url, spool_dir, CollectorRegistry())
    b = fast_writer(dead_url, spool_dir, CollectorRegistry())
    await a.start()
    await b.start()
    assert a.spool.own_path != b.spool.own_path
    a.submit(make_turn(0, "a"))
    b.submit(make_turn(0, "b"))
    await a.stop()
    await b.stop()
    assert len(spool_lines(spool_dir)) == 2

    c = fast_writer(redis_url, spool_dir, CollectorRegistry())
    await c.start()
    await wait_for(lambda: c.spool_backlog == 0)
    await c.stop()
    assert sorted(t.session_id for t in await stream_turns(redis_url)) == ["a", "b"]
    assert spool_lines(spool_dir) == []


async def test_a_redis_that_never_answers_is_spooled_after_the_socket_timeout(
    data_dir: Path,
) -> None:
    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accept and never reply: a hung server or a partition
        writer.close()

    hung = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = hung.sockets[0].getsockname()[1]
    registry = CollectorRegistry()
    writer = TraceWriter(
        f"redis://127.0.0.1:{port}/0", data_dir / "spool", registry, socket_timeout_s=0.3
    )
    try:
        await writer.start()
        started = time.perf_counter()
        for i in range(3):
            writer.submit(make_turn(i))
        assert time.perf_counter() - started < 0.005
        await wait_for(lambda: writer.spool_backlog == 3, timeout_s=5.0)
        await writer.stop()
    finally:
        hung.close()
    assert len(spool_lines(data_dir / "spool")) == 3
    assert sample(registry, "liveloop_trace_records_total", outcome="written") == 0

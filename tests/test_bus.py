"""Stream helpers against a real Valkey: exactly-once publish, resume, reclaim, dead letters."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aredis

from liveloop import bus
from liveloop.contracts import Feedback


def fb(i: int) -> Feedback:
    return Feedback(session_id=f"s{i}", turn_index=0, score=0.5, tenant="t")


async def test_publish_once_per_dedupe_key(aredis_client: aredis.Redis) -> None:
    first = await bus.publish(aredis_client, "feedback", fb(1), dedupe_key="s1:0")
    again = await bus.publish(aredis_client, "feedback", fb(1), dedupe_key="s1:0")
    assert first is not None and again is None
    entries = await aredis_client.xrange("liveloop:feedback")
    assert len(entries) == 1
    assert bus.decode(entries[0][1], Feedback).session_id == "s1"


async def test_consumer_resumes_reclaims_and_dead_letters(aredis_client: aredis.Redis) -> None:
    for i in range(3):
        await bus.publish(aredis_client, "feedback", fb(i))
    a = bus.StreamConsumer(aredis_client, "feedback", "g", "a", claim_idle_ms=100, max_attempts=2)
    await a.ensure_group()
    got = await a.read(block_ms=100)
    assert [e.parse(Feedback).session_id for e in got] == ["s0", "s1", "s2"]
    await a.ack(got[0].id)

    # "a" dies; a restarted "a" first gets back its own pending entries.
    a2 = bus.StreamConsumer(aredis_client, "feedback", "g", "a", claim_idle_ms=100, max_attempts=2)
    assert [e.id for e in await a2.read(block_ms=100)] == [got[1].id, got[2].id]

    # Another consumer reclaims them once they are idle long enough.
    b = bus.StreamConsumer(aredis_client, "feedback", "g", "b", claim_idle_ms=100, max_attempts=2)
    b._resumed = True
    await asyncio.sleep(0.15)
    reclaimed = await b.read(block_ms=100)
    assert {e.id for e in reclaimed} == {got[1].id, got[2].id}
    await b.ack(got[1].id)
    assert await b.fail(reclaimed[1], "boom 1") is False
    assert await b.fail(reclaimed[1], "boom 2") is True
    dead = await aredis_client.xrange("liveloop:feedback:dlq")
    assert len(dead) == 1 and dead[0][1]["error"] == "boom 2"
    assert dead[0][1]["source_id"] == got[2].id
    lag, pending = await b.lag()
    assert (lag, pending) == (0, 0)


async def test_connect_unreachable_is_one_line() -> None:
    with pytest.raises(bus.BusUnavailable, match=r"cannot reach Redis at redis://127\.0\.0\.1:1/0"):
        await bus.connect("redis://127.0.0.1:1/0")

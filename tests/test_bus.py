"""Stream helpers against a real Valkey: exactly-once publish, resume, reclaim, dead letters."""

from __future__ import annotations

import pytest
import redis.asyncio as aredis

from liveloop import bus
from liveloop.contracts import Feedback
from tests.conftest import wait_for


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
    reclaimed: list[bus.Entry] = []

    async def reclaims() -> bool:  # once they have been idle for claim_idle_ms
        reclaimed.extend(await b.read(block_ms=10))
        return bool(reclaimed)

    await wait_for(reclaims)
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


async def test_exactly_once_write_refuses_duplicates_and_taken_members(
    aredis_client: aredis.Redis,
) -> None:
    once = bus.ExactlyOnce(aredis_client)
    members = "liveloop:test:members"
    first = await once.write("out", "b1", {"data": "1"}, members=["t1", "t2"], member_set=members)
    assert first.written and first.entry_id is not None
    again = await once.write("out", "b1", {"data": "1"}, members=["t1", "t2"], member_set=members)
    assert (again.status, again.entry_id) == ("dup", None)
    taken = await once.write("out", "b2", {"data": "2"}, members=["t3", "t2"], member_set=members)
    assert (taken.status, taken.taken) == ("taken", "t2")
    assert await aredis_client.xlen("liveloop:out") == 1
    assert not await aredis_client.exists(bus.dedupe_marker("out", "b2"))  # refused: no marker
    assert set(await aredis_client.zrange(members, 0, -1)) == {"t1", "t2"}


async def test_exactly_once_cleanup_runs_whether_or_not_the_entry_is_new(
    aredis_client: aredis.Redis,
) -> None:
    once = bus.ExactlyOnce(aredis_client)
    for attempt in range(2):
        await aredis_client.set("liveloop:test:state", "x")
        await aredis_client.sadd("liveloop:test:set", "k", "other")
        cleanup = [bus.Cleanup("liveloop:test:state"), bus.Cleanup("liveloop:test:set", "k")]
        async with aredis_client.pipeline(transaction=False) as pipe:
            await once.queue(pipe, "out", "k", {"data": "d", "n": str(attempt)}, cleanup=cleanup)
            (reply,) = await pipe.execute()
        assert bus.OnceResult.parse(reply).written is (attempt == 0)
        assert not await aredis_client.exists("liveloop:test:state")
        assert await aredis_client.smembers("liveloop:test:set") == {"other"}
    entries = await aredis_client.xrange("liveloop:out")
    assert [f for _id, f in entries] == [{"data": "d", "n": "0"}]


async def test_consumer_skips_in_flight_entries_and_waits_for_the_retry_time(
    aredis_client: aredis.Redis,
) -> None:
    for i in range(2):
        await bus.publish(aredis_client, "feedback", fb(i))
    c = bus.StreamConsumer(aredis_client, "feedback", "g", "a", claim_idle_ms=0, backoff_max_s=60.0)
    await c.ensure_group()
    first, second = await c.read(block_ms=100)
    c.in_flight.add(first.id)
    assert await c.fail(second, "boom") is False  # retry in claim_idle_ms (0 s) doubled, capped
    assert c.retry_delay_s(1) == 0.0
    await aredis_client.hset(bus.keys.retry_key("feedback", "g"), second.id, "9e18")
    assert await c.read(block_ms=10) == []  # one in flight here, one not due yet
    c.in_flight.clear()
    assert [e.id for e in await c.read(block_ms=10)] == [first.id]


async def test_dead_letter_writes_given_letters_and_acks_on_a_pipeline(
    aredis_client: aredis.Redis,
) -> None:
    await bus.publish(aredis_client, "turns", fb(1))
    c = bus.StreamConsumer(
        aredis_client, "turns", "g", "a", dead_letter_stream="elsewhere", delete_acked=True
    )
    await c.ensure_group()
    (entry,) = await c.read(block_ms=100)
    await c.dead_letter(entry, "bad", [{"data": "x", "turn_key": "s:0:0"}], attempts=3)
    (dead,) = [f for _id, f in await aredis_client.xrange("liveloop:elsewhere")]
    assert dead == {
        "data": "x",
        "turn_key": "s:0:0",
        "error": "bad",
        "source_id": entry.id,
        "source_stream": "liveloop:turns",
        "attempts": "3",
    }
    assert await aredis_client.xlen("liveloop:turns") == 0  # delete_acked
    assert await c.lag() == (0, 0)


async def test_decode_entries_skips_malformed_entries(aredis_client: aredis.Redis) -> None:
    await bus.publish(aredis_client, "feedback", fb(1))
    await aredis_client.xadd("liveloop:feedback", {"data": "{broken"})
    await aredis_client.xadd("liveloop:feedback", {"other": "x"})
    await bus.publish(aredis_client, "feedback", fb(2))
    entries = await aredis_client.xrange("liveloop:feedback")
    assert [f.session_id for f in bus.decode_entries(entries, Feedback)] == ["s1", "s2"]


async def test_a_group_lost_with_redis_data_is_created_again(aredis_client: aredis.Redis) -> None:
    consumer = bus.StreamConsumer(aredis_client, "feedback", "g", "a")
    await consumer.ensure_group()
    await bus.publish(aredis_client, "feedback", fb(0))
    assert len(await consumer.read(block_ms=100)) == 1
    await aredis_client.flushdb()  # Redis restarted without its data
    assert await consumer.lag() == (0, 0)  # no stream: nothing to report, no error
    assert await consumer.read(block_ms=100) == []  # the group is created again
    await bus.publish(aredis_client, "feedback", fb(1))
    got = await consumer.read(block_ms=100)
    assert [e.parse(Feedback).session_id for e in got] == ["s1"]
    groups = await aredis_client.xinfo_groups("liveloop:feedback")
    assert [g["name"] for g in groups] == ["g"]

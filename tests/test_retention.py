"""Stream retention on a real Valkey: what is trimmed, what stays, the archive, the lock."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aredis

from liveloop.bus import keys
from liveloop.bus.archive import Archive, parse_id
from liveloop.bus.consumer import group_info
from liveloop.bus.retention import Retention, RetentionMetrics
from liveloop.config.retention import KeepNewest, RetentionSettings, StreamWindows
from tests.synthetic import make_turn, user

TURNS = "liveloop:turns"


def settings(
    archive: Path, window_s: float = 0.0, keep: int = 0, **extra: Any
) -> RetentionSettings:
    """Every stream with the same window and floor (weights keeps at least one)."""
    windows = {name: window_s for name in StreamWindows.model_fields}
    floors = {name: keep for name in KeepNewest.model_fields} | {"weights": max(keep, 1)}
    return RetentionSettings(
        windows=StreamWindows(**windows),
        keep_newest=KeepNewest(**floors),
        archive_dir=archive,
        **extra,
    )


async def add_turns(client: aredis.Redis, count: int, stream: str = TURNS) -> list[str]:
    ids = []
    for i in range(count):
        turn = make_turn(f"s{i}", 0, [user(f"question {i}")], f"answer {i}")
        ids.append(str(await client.xadd(stream, {"data": turn.model_dump_json(), "i": str(i)})))
    # An entry is older than a window of 0 only once Redis' clock has left its millisecond.
    await asyncio.sleep(0.002)
    return ids


async def deliver(client: aredis.Redis, group: str, count: int, stream: str = TURNS) -> list[str]:
    reply: Any = await client.xreadgroup(group, "c1", {stream: ">"}, count=count)
    return [str(entry_id) for entry_id, _ in reply[0][1]]


async def remaining(client: aredis.Redis, stream: str = TURNS) -> list[str]:
    return [str(entry_id) for entry_id, _ in await client.xrange(stream)]


def report_of(reports: list[Any] | None, stream: str) -> Any:
    assert reports is not None
    return next(r for r in reports if r.stream == stream)


async def test_only_acknowledged_entries_older_than_the_window_go(
    aredis_client: aredis.Redis, tmp_path: Path
) -> None:
    client = aredis_client
    ids = await add_turns(client, 10)
    original = {str(i): dict(f) for i, f in await client.xrange(TURNS)}
    trim_all = Retention(client, settings(tmp_path), tmp_path)

    # No `prm` group yet: it would read the stream from its start, so nothing goes.
    turns = report_of(await trim_all.run_once(), "turns")
    assert turns.skipped == "a reading group does not exist yet" and turns.trimmed == 0
    assert await remaining(client) == ids

    await client.xgroup_create(TURNS, keys.PRM_GROUP, id="0")
    delivered = await deliver(client, keys.PRM_GROUP, 6)
    await client.xack(TURNS, keys.PRM_GROUP, *delivered[:4])  # 4 acked, 2 pending, 4 undelivered

    keep_a_day = Retention(client, settings(tmp_path, window_s=3600), tmp_path)
    assert report_of(await keep_a_day.run_once(), "turns").trimmed == 0  # all too young
    keep_eight = Retention(client, settings(tmp_path, keep=8), tmp_path)
    assert report_of(await keep_eight.run_once(), "turns").trimmed == 2  # 10 - the newest 8
    assert await remaining(client) == ids[2:]

    # Another group that has read nothing holds everything back.
    await client.xgroup_create(TURNS, "audit", id="0")
    assert report_of(await trim_all.run_once(), "turns").trimmed == 0
    await client.xgroup_destroy(TURNS, "audit")

    turns = report_of(await trim_all.run_once(), "turns")
    assert (turns.archived, turns.trimmed) == (2, 2)  # the acked ones, not the pending ones
    assert await remaining(client) == ids[4:]

    archived = list(Archive(tmp_path).entries(TURNS))
    assert archived == [(i, original[i]) for i in ids[:4]]  # exactly the trimmed, as they were


async def test_lag_of_a_group_stays_countable_after_a_trim(
    aredis_client: aredis.Redis, tmp_path: Path
) -> None:
    """The collector's backpressure reads the trainer group's lag: trimming must keep it."""
    stream = keys.stream_key(keys.BATCHES)
    await add_turns(aredis_client, 8, stream)
    await aredis_client.xgroup_create(stream, keys.TRAINER_GROUP, id="0")
    await aredis_client.xack(
        stream, keys.TRAINER_GROUP, *await deliver(aredis_client, keys.TRAINER_GROUP, 5, stream)
    )

    reports = await Retention(aredis_client, settings(tmp_path), tmp_path).run_once()

    assert report_of(reports, "batches").trimmed == 5
    info = await group_info(aredis_client, stream, keys.TRAINER_GROUP)
    assert info is not None and info["lag"] == 3


async def test_weights_and_dead_letters_need_no_group(
    aredis_client: aredis.Redis, tmp_path: Path
) -> None:
    weights = keys.stream_key(keys.WEIGHTS)
    ids = await add_turns(aredis_client, 10, weights)
    dead = await add_turns(aredis_client, 3, keys.dlq_key(keys.SCORED))

    reports = await Retention(aredis_client, settings(tmp_path, keep=3), tmp_path).run_once()

    assert report_of(reports, "weights").trimmed == 7
    assert await remaining(aredis_client, weights) == ids[7:]  # the newest 3 announcements
    assert report_of(reports, "scored.dlq").trimmed == 0  # no more than keep_newest
    reports = await Retention(aredis_client, settings(tmp_path), tmp_path).run_once()
    assert report_of(reports, "scored.dlq").trimmed == 3
    assert [i for i, _ in Archive(tmp_path).entries("scored:dlq")] == dead
    assert [i for i, _ in Archive(tmp_path).entries(weights)] == ids[:9]  # weights keep one


async def test_a_pass_goes_on_chunk_by_chunk(aredis_client: aredis.Redis, tmp_path: Path) -> None:
    ids = await add_turns(aredis_client, 8)
    await aredis_client.xgroup_create(TURNS, keys.PRM_GROUP, id="0")
    await aredis_client.xack(
        TURNS, keys.PRM_GROUP, *await deliver(aredis_client, keys.PRM_GROUP, 8)
    )

    reports = await Retention(
        aredis_client, settings(tmp_path, chunk_entries=3), tmp_path
    ).run_once()

    turns = report_of(reports, "turns")
    assert (turns.archived, turns.trimmed, turns.files) == (8, 8, 3)  # 3 + 3 + 2
    archive = Archive(tmp_path)
    assert [(f.first, f.last) for f in archive.files(TURNS)] == [
        (parse_id(ids[0]), parse_id(ids[2])),
        (parse_id(ids[3]), parse_id(ids[5])),
        (parse_id(ids[6]), parse_id(ids[7])),
    ]
    assert [i for i, _ in archive.entries(TURNS)] == ids


class CrashBeforeTrim(Retention):
    """Retention that dies between writing the archive and trimming."""

    async def _script(self, stream: Any, mode: str, cut: str) -> tuple[int, str]:
        if mode == "trim":
            raise RuntimeError("killed before the trim")
        return await super()._script(stream, mode, cut)


async def test_a_crash_between_archive_and_trim_loses_and_duplicates_nothing(
    aredis_client: aredis.Redis, tmp_path: Path
) -> None:
    client = aredis_client
    ids = await add_turns(client, 6)
    await client.xgroup_create(TURNS, keys.PRM_GROUP, id="0")
    await client.xack(TURNS, keys.PRM_GROUP, *await deliver(client, keys.PRM_GROUP, 4))

    with pytest.raises(RuntimeError, match="killed"):
        await CrashBeforeTrim(client, settings(tmp_path), tmp_path).run_once()
    assert await remaining(client) == ids  # nothing trimmed
    assert [i for i, _ in Archive(tmp_path).entries(TURNS)] == ids[:4]  # but archived
    assert await client.get(keys.RETENTION_LOCK) is None  # and the lock released

    ids += await add_turns(client, 2)  # more arrive and are acknowledged before the next pass
    await client.xack(TURNS, keys.PRM_GROUP, *await deliver(client, keys.PRM_GROUP, 10))
    turns = report_of(await Retention(client, settings(tmp_path), tmp_path).run_once(), "turns")

    assert turns.trimmed == 8 and await remaining(client) == []
    archive = Archive(tmp_path)
    assert len(archive.files(TURNS)) == 2  # the first range is in both files ...
    assert [i for i, _ in archive.entries(TURNS)] == ids  # ... and read back once, in order
    assert [i for i, _ in archive.entries(TURNS, min_id=ids[3], max_id=ids[5])] == ids[3:6]


async def test_the_lock_lets_one_trimmer_at_a_time(
    aredis_client: aredis.Redis, redis_url: str, tmp_path: Path
) -> None:
    client = aredis_client
    await add_turns(client, 5)
    await client.xgroup_create(TURNS, keys.PRM_GROUP, id="0")
    await client.xack(TURNS, keys.PRM_GROUP, *await deliver(client, keys.PRM_GROUP, 5))
    other = aredis.from_url(redis_url, decode_responses=True)
    metrics = [RetentionMetrics(), RetentionMetrics()]
    first = Retention(client, settings(tmp_path / "a"), tmp_path, metrics[0])
    second = Retention(other, settings(tmp_path / "b"), tmp_path, metrics[1])
    try:
        results = await asyncio.gather(first.run_once(), second.run_once())
        done = [r for r in results if r is not None]
        assert len(done) == 1 and report_of(done[0], "turns").trimmed == 5
        busy = [m.passes.labels("busy")._value.get() for m in metrics]
        assert sorted(busy) == [0, 1]
        # Only one archive holds the entries: the busy one archived nothing either.
        archived = [len(list(Archive(tmp_path / d).entries(TURNS))) for d in ("a", "b")]
        assert sorted(archived) == [0, 5]

        # A trimmer whose lock was taken over (it expired) trims nothing.
        await add_turns(client, 3)
        await client.xack(TURNS, keys.PRM_GROUP, *await deliver(client, keys.PRM_GROUP, 3))
        assert await client.set(keys.RETENTION_LOCK, first.token)
        await client.set(keys.RETENTION_LOCK, second.token)  # taken over meanwhile
        stream = first.streams[0]
        assert stream.key == TURNS
        assert await first._script(stream, "trim", "99999999999999-0") == (-1, "")
        assert len(await remaining(client)) == 3
    finally:
        await other.aclose()

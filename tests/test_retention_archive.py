"""The retention archive in use: replaying trimmed turns, a tenant's purge, the collector's pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio as aredis

from liveloop.bus import keys
from liveloop.bus.archive import Archive, ArchiveWriter
from liveloop.bus.archive_purge import purge_tenant
from liveloop.bus.retention import Retention
from liveloop.config.retention import KeepNewest, RetentionSettings, StreamWindows
from liveloop.contracts import BatchSample, Feedback, ScoredTurn, TrainingBatch, TurnRecord
from liveloop.valkey import free_port
from tests.conftest import wait_until
from tests.synthetic import conversation, make_turn, user, write_turns
from tests.test_trainer_e2e import stop

ROOT = Path(__file__).resolve().parents[1]
TURNS, FEEDBACK = "liveloop:turns", "liveloop:feedback"


def no_window() -> RetentionSettings:
    return RetentionSettings(
        windows=StreamWindows(turns=0, feedback=0), keep_newest=KeepNewest(turns=0)
    )


async def consume(client: aredis.Redis, stream: str, count: int) -> None:
    """What the judging loop does: its group reads `count` entries and acknowledges them."""
    await client.xgroup_create(stream, keys.PRM_GROUP, id="0", mkstream=True)
    reply = await client.xreadgroup(keys.PRM_GROUP, "c1", {stream: ">"}, count=count)
    await client.xack(stream, keys.PRM_GROUP, *[i for i, _ in reply[0][1]])


def replay(redis_url: str, data_dir: Path, to_stream: str, *archive: str) -> dict[str, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LIVELOOP_PRM__RULES__TIMEOUT_SCORE": "0.0"}
    args = [sys.executable, "-m", "liveloop.cli", "judge", "--replay", "--judge", "rules"]
    args += ["--to-stream", to_stream, "--redis-url", redis_url, "--data-dir", str(data_dir)]
    done = subprocess.run(
        [*args, *archive], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    summary: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])["replay"]
    return summary


def scores(redis_url: str, stream: str) -> dict[str, tuple[float, str]]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    turns = [ScoredTurn.model_validate_json(f["data"]) for _, f in client.xrange(stream)]
    client.close()
    return {t.key: (t.score, t.signal) for t in turns}


async def test_replay_rescores_turns_trimmed_into_the_archive(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    a = conversation("a", [user("hi"), user("no, that's wrong"), user("thanks!")])
    b = conversation("b", [user("hello")])
    await write_turns(aredis_client, [*a, *b])
    feedback = Feedback(session_id="b", turn_index=0, score=0.25, tenant="t")
    await aredis_client.xadd(FEEDBACK, {"data": feedback.model_dump_json()})
    await consume(aredis_client, TURNS, 2)  # a:0 and a:1 judged ...
    await consume(aredis_client, FEEDBACK, 1)

    reports = await Retention(aredis_client, no_window(), data_dir).run_once()  # ... and trimmed

    assert reports is not None
    assert {r.stream: r.trimmed for r in reports if r.trimmed} == {"turns": 2, "feedback": 1}
    assert await aredis_client.xlen(TURNS) == 2 and await aredis_client.xlen(FEEDBACK) == 0
    # Without the archive, the replay sees only what is left in Redis.
    assert replay(redis_url, data_dir, "live-only")["read"] == 2
    # With it (default place: <data-dir>/archive), the archive first, then Redis: a:0 is
    # paired with a:1 across the two, b:0 with its archived feedback.
    summary = replay(redis_url, data_dir, "with-archive", "--archive")
    assert (summary["read"], summary["from_archive"], summary["scored"]) == (4, 2, 4)
    assert scores(redis_url, "liveloop:with-archive") == {
        "a:0:0": (-1.0, "next_turn"),
        "a:1:0": (1.0, "next_turn"),
        "a:2:0": (0.0, "timeout"),
        "b:0:0": (0.25, "feedback"),
    }


def batch(batch_id: str, *turns: TurnRecord) -> TrainingBatch:
    samples = [
        BatchSample(
            key=t.key,
            prompt_token_ids=t.prompt_token_ids,
            completion_token_ids=t.completion_token_ids,
            logprobs=t.logprobs,
            versions=t.versions,
            advantage=0.5,
            score=1.0,
        )
        for t in turns
    ]
    tokens = sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples)
    return TrainingBatch(batch_id=batch_id, trainer_version=0, num_tokens=tokens, samples=samples)


def archive_stream(root: Path, stream: str, payloads: list[str], start_ms: int) -> None:
    writer = ArchiveWriter(root, stream)
    writer.add((f"{start_ms}-{i}", {"data": p, "n": str(i)}) for i, p in enumerate(payloads))
    writer.close()


def test_a_tenants_purge_removes_its_entries_and_samples_from_the_archive(tmp_path: Path) -> None:
    def turn(session: str, tenant: str) -> TurnRecord:
        return make_turn(session, 0, [user("q")], "r").model_copy(update={"tenant": tenant})

    gone1, gone2, kept = turn("x:1", "t1"), turn("x:2", "t1"), turn("y", "t2")
    ms = 1_700_000_000_000
    archive_stream(tmp_path, TURNS, [t.model_dump_json() for t in (gone1, kept, gone2)], ms)
    archive_stream(tmp_path, "liveloop:turns:dlq", [gone2.model_dump_json()], ms)
    fb = Feedback(session_id="x:1", turn_index=0, score=1.0, tenant="t1")
    archive_stream(tmp_path, FEEDBACK, [fb.model_dump_json()], ms)
    mixed, only_t1 = batch("b-mixed", gone1, kept), batch("b-t1", gone2)
    by_file = TrainingBatch(batch_id="b-file", trainer_version=0, num_tokens=9, path="batches/f")
    batches = [mixed.model_dump_json(), only_t1.model_dump_json(), by_file.model_dump_json()]
    archive_stream(tmp_path, "liveloop:batches", batches, ms)
    kept_turn = next(f for _, f in Archive(tmp_path).entries(TURNS) if "t2" in f["data"])

    report = purge_tenant(tmp_path, "t1")

    archive = Archive(tmp_path)
    assert [f for _, f in archive.entries(TURNS)] == [kept_turn]  # t2's entry as it was
    assert list(archive.entries("liveloop:turns:dlq")) == list(archive.entries(FEEDBACK)) == []
    left = [TrainingBatch.model_validate_json(f["data"]) for _, f in archive.entries("batches")]
    assert [(b.batch_id, [s.key for s in b.samples or []]) for b in left] == [
        ("b-mixed", [kept.key]),
        ("b-file", []),
    ]
    assert left[0].num_tokens == len(kept.prompt_token_ids) + len(kept.completion_token_ids)
    assert report.sessions == ["x:1", "x:2"] and report.samples_removed == 2
    assert report.entries_removed == 5  # 2 turns, 1 dead letter, 1 feedback, 1 batch
    assert report.referenced_batch_files == ["batches/f"]  # not in the archive: for the caller
    assert purge_tenant(tmp_path, "t1").entries_removed == 0  # nothing left of t1


@pytest.mark.slow
def test_the_collecting_loop_archives_and_trims_with_metrics(
    redis_url: str, data_dir: Path
) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    dead = [
        client.xadd(
            "liveloop:scored:dlq", {"data": make_turn(f"d{i}", 0, [], "x").model_dump_json()}
        )
        for i in range(4)
    ]
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "LIVELOOP_RETENTION__INTERVAL_S": "0.2",
        "LIVELOOP_RETENTION__WINDOWS__DEAD_LETTERS": "0",
    }
    args = [sys.executable, "-m", "liveloop.cli", "collect", "--redis-url", redis_url]
    args += ["--data-dir", str(data_dir), "--metrics-port", str(port), "--log-level", "WARNING"]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stderr=subprocess.PIPE)
    series = 'liveloop_retention_trimmed_entries_total{stream="scored.dlq"} 4.0'
    try:

        def trimmed() -> bool:
            assert proc.poll() is None, stop(proc)
            try:
                return series in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            except httpx.HTTPError:
                return False

        wait_until(trimmed, timeout_s=60, what="a retention pass in the collector")
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    finally:
        code, err = stop(proc)
    assert code == 0, err
    assert client.xlen("liveloop:scored:dlq") == 0
    assert 'liveloop_retention_archived_entries_total{stream="scored.dlq"} 4.0' in text
    assert [i for i, _ in Archive(data_dir / "archive").entries("scored:dlq")] == dead

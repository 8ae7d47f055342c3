"""`liveloop judge` as real processes: shared work, crash and resume, metrics, start-up errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import redis

from liveloop.contracts import Feedback
from liveloop.valkey import free_port
from tests.conftest import wait_until
from tests.synthetic import conversation, tool, user

ROOT = Path(__file__).resolve().parents[1]


def judge_env(redis_url: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(
        OMP_NUM_THREADS="1",
        LIVELOOP_REDIS_URL=redis_url,
        LIVELOOP_LOG_LEVEL="WARNING",
        LIVELOOP_PRM__CONSUMER__CLAIM_IDLE_MS="1000",
        LIVELOOP_PRM__NEXT_STATE_TIMEOUT_S="1.5",
        LIVELOOP_PRM__RULES__TIMEOUT_SCORE="0.0",
    )
    env.update(extra)
    return env


def start_judge(redis_url: str, name: str, *args: str) -> subprocess.Popen[bytes]:
    env = judge_env(redis_url, LIVELOOP_PRM__CONSUMER__NAME=name)
    return subprocess.Popen(
        [sys.executable, "-m", "liveloop.cli", "judge", *args], env=env, cwd=ROOT
    )


def fill(client: redis.Redis, sessions: int, turns_per_session: int) -> int:
    steps = [user("hi"), user("thanks"), [tool("error: nope")], user("try again"), user("ok")]
    pipe = client.pipeline(transaction=False)
    convs = [
        conversation(f"s{s}", [steps[(s + i) % len(steps)] for i in range(turns_per_session)])
        for s in range(sessions)
    ]
    for i in range(turns_per_session):
        for conv in convs:
            turn = conv[i]
            pipe.xadd(
                "liveloop:turns", {"data": turn.model_dump_json(), "session_id": turn.session_id}
            )
    for conv in convs[::2]:  # half the sessions end with explicit feedback, half time out
        fb = Feedback(
            session_id=conv[-1].session_id, turn_index=conv[-1].turn_index, score=1, tenant="t"
        )
        pipe.xadd("liveloop:feedback", {"data": fb.model_dump_json()})
    pipe.execute()
    return sessions * turns_per_session


def wait_scored(client: redis.Redis, n: int, timeout_s: float = 60.0) -> None:
    wait_until(lambda: client.xlen("liveloop:scored") >= n, timeout_s, what=f"{n} scored turns")


def wait_reading(client: redis.Redis, name: str, since: float, timeout_s: float = 60.0) -> None:
    """Wait until consumer `name` has read `liveloop:turns` after `since` (time.monotonic()).

    A judge reads only once it is connected and handles SIGTERM, so it stops cleanly then.
    """

    def read_since() -> bool:
        consumers = client.xinfo_consumers("liveloop:turns", "prm")
        idle_ms = next((int(c["idle"]) for c in consumers if c["name"] == name), None)
        return idle_ms is not None and idle_ms < (time.monotonic() - since) * 1000

    wait_until(read_since, timeout_s, what=f"a read by the restarted judge {name}")


def reading(client: redis.Redis) -> set[str]:
    """The judges that have read `liveloop:turns` in the judges' group."""
    try:
        return {str(c["name"]) for c in client.xinfo_consumers("liveloop:turns", "prm")}
    except redis.ResponseError:  # no stream or group yet
        return set()


def stop(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        assert p.wait(20) == 0


def test_two_processes_share_work_survive_a_crash_and_score_each_turn_once(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    metrics_port = free_port()
    p1 = start_judge(redis_url, "p1")
    p2 = start_judge(redis_url, "p2", "--metrics-port", str(metrics_port))
    try:
        # Both read before there is work: a judge that started first could otherwise score
        # the first fifth alone, and the other would have no share to lose in the crash.
        wait_until(lambda: reading(client) >= {"p1", "p2"}, 60, what="both judges reading")
        total = fill(client, sessions=100, turns_per_session=10)
        wait_scored(client, total // 5)
        p1.send_signal(signal.SIGKILL)  # dies with entries in flight
        p1.wait(10)
        assert client.xlen("liveloop:scored") < total
        restarted = time.monotonic()
        p1 = start_judge(redis_url, "p1")  # a restarted judge resumes its own pending work
        wait_scored(client, total)
        wait_reading(client, "p1", restarted)
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    finally:
        stop(p1, p2)
    entries = [f for _i, f in client.xrange("liveloop:scored")]
    keys = {(f["session_id"], f["turn_index"]) for f in entries}
    assert len(entries) == total == len(keys)  # every turn scored, none twice
    assert {f["signal"] for f in entries} == {"next_turn", "feedback", "timeout"}
    assert {f["judged_by"] for f in entries} == {"p1", "p2"}  # both did a share
    assert client.xpending("liveloop:turns", "prm")["pending"] == 0
    assert client.zcard("liveloop:prm:deadlines") == 0
    text = body.decode()
    for name in (
        "liveloop_prm_judge_latency_seconds_bucket",
        "liveloop_prm_judge_score_bucket",
        "liveloop_prm_consumer_lag",
        "liveloop_prm_consumer_pending",
        "liveloop_prm_dead_letters_total",
    ):
        assert name in text
    assert 'liveloop_prm_turns_total{outcome="scored"}' in text


def test_unknown_judge_stops_startup_with_one_line(redis_url: str) -> None:
    env = judge_env(redis_url, LIVELOOP_PRM__JUDGES=json.dumps({"rules": 1, "nope": 1}))
    result = subprocess.run(
        [sys.executable, "-m", "liveloop.cli", "judge"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "unknown judge 'nope'; available judges: feedback, llm, rules" in lines[0]

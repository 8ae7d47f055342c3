"""Benchmark of the judging loop: turns/s through the `rules` judge, end to end.

Fills `liveloop:turns` of an embedded Valkey with sessions of several turns (user replies
with thanks, corrections, neutral follow-ups and tool errors; the last turn of each session
gets explicit feedback, so every turn has a next state), then starts 1 and then 2
`liveloop judge` processes and measures how fast `liveloop:scored` fills up: from the first
scored entry to the last (`turns_per_s`) and from process start (`turns_per_s_with_startup`).
On a shared machine the wall-clock rate depends on what else runs, so it also reports the
CPU the judge processes and Valkey spent per turn over the same span (`turns_per_cpu_s`
is the rate one uncontended core would sustain). It checks that every turn was scored
exactly once, and prints one JSON object.

    python bench/judge.py [--turns N] [--turns-per-session K]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import redis.asyncio as aredis  # noqa: E402

from liveloop import bus  # noqa: E402
from liveloop.contracts import Feedback, TurnRecord  # noqa: E402
from liveloop.valkey import EmbeddedValkey  # noqa: E402
from tests.synthetic import conversation, tool, user, write_turns  # noqa: E402

REPLIES = [
    user("thanks, that's perfect"),
    user("no, that's wrong, try again"),
    user("ok. and what about the next step?"),
    [tool("Traceback (most recent call last):\n  File 'x.py'\nKeyError: 'a'")],
    [tool("exit code 0\n3 files changed")],
]


def build_turns(total: int, per_session: int) -> tuple[list[TurnRecord], list[Feedback]]:
    """Sessions interleaved the way concurrent users produce them."""
    sessions = max(1, total // per_session)
    convs = []
    for s in range(sessions):
        steps: list[Any] = [user(f"task {s}: please help")]
        steps += [REPLIES[(s + i) % len(REPLIES)] for i in range(per_session - 1)]
        convs.append(conversation(f"bench-{s}", steps, prompt_tokens=256, completion_tokens=64))
    turns = [c[i] for i in range(per_session) for c in convs]
    feedback = [
        Feedback(session_id=c[-1].session_id, turn_index=c[-1].turn_index, score=0.5, tenant="t")
        for c in convs
    ]
    return turns, feedback


async def fill(url: str, turns: list[TurnRecord], feedback: list[Feedback]) -> None:
    client = bus.redis_client(url)
    await client.flushdb()
    await write_turns(client, turns)
    for fb in feedback:
        await bus.publish(client, bus.FEEDBACK, fb)
    await client.aclose()


def _cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        times = proc.cpu_times()
        total += times.user + times.system
    return total


async def watch(
    url: str,
    expected: int,
    started: float,
    timeout_s: float,
    judges: list[psutil.Process],
    valkey: psutil.Process,
) -> dict[str, Any]:
    """Poll the scored stream until every turn is there; CPU is measured over the same span."""
    client = bus.redis_client(url)
    first: float | None = None
    done: float | None = None
    cpu0 = cpu1 = (0.0, 0.0)
    scored_key = bus.stream_key(bus.SCORED)
    while time.monotonic() - started < timeout_s:
        n = int(await client.xlen(scored_key))
        now = time.monotonic()
        if n and first is None:
            first, cpu0 = now, (_cpu_s(judges), _cpu_s([valkey]))
        if n >= expected:
            done, cpu1 = now, (_cpu_s(judges), _cpu_s([valkey]))
            break
        await asyncio.sleep(0.02)
    keys = set()
    async for _id, fields in _scan(client, scored_key):
        data = json.loads(fields["data"])
        keys.add(f"{data['session_id']}:{data['turn_index']}:{data['sample_index']}")
    n = int(await client.xlen(scored_key))
    await client.aclose()
    if done is None or first is None:
        return {"error": f"only {n} of {expected} turns scored in {timeout_s}s"}
    judge_us = 1e6 * (cpu1[0] - cpu0[0]) / expected
    return {
        "turns_per_s": round(expected / max(done - first, 1e-9), 1),
        "turns_per_s_with_startup": round(expected / (done - started), 1),
        "seconds": round(done - first, 3),
        "seconds_with_startup": round(done - started, 3),
        "judge_cpu_us_per_turn": round(judge_us, 1),
        "valkey_cpu_us_per_turn": round(1e6 * (cpu1[1] - cpu0[1]) / expected, 1),
        "turns_per_cpu_s": round(1e6 / max(judge_us, 1e-9), 1),
        "scored_entries": n,
        "scored_exactly_once": n == expected == len(keys),
    }


async def _scan(client: aredis.Redis, key: str) -> Any:
    start = "-"
    while True:
        batch: Any = await client.xrange(key, min=start, count=2000)
        if not batch:
            return
        for item in batch:
            yield item
        start = "(" + batch[-1][0]


def run_case(
    valkey: EmbeddedValkey, turns: list[TurnRecord], fbs: list[Feedback], processes: int
) -> dict[str, Any]:
    """Fill the streams, start `processes` judges, time them, stop them."""
    url = valkey.url
    asyncio.run(fill(url, turns, fbs))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(
        OMP_NUM_THREADS="1",
        LIVELOOP_REDIS_URL=url,
        LIVELOOP_LOG_LEVEL="WARNING",
        LIVELOOP_PRM__JUDGES=json.dumps({"feedback": 1.0, "rules": 1.0}),
        LIVELOOP_PRM__NEXT_STATE_TIMEOUT_S="60",
    )
    started = time.monotonic()
    procs = [
        subprocess.Popen([sys.executable, "-m", "liveloop.cli", "judge"], env=env, cwd=ROOT)
        for _ in range(processes)
    ]
    try:
        assert valkey.process is not None
        judges = [psutil.Process(p.pid) for p in procs]
        vk = psutil.Process(valkey.process.pid)
        result = asyncio.run(watch(url, len(turns), started, 300, judges, vk))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20_000)
    parser.add_argument("--turns-per-session", type=int, default=10)
    args = parser.parse_args()
    turns, fbs = build_turns(args.turns, args.turns_per_session)
    report: dict[str, Any] = {
        "benchmark": "judge: liveloop:turns -> rules+feedback judges -> liveloop:scored",
        "turns": len(turns),
        "turns_per_session": args.turns_per_session,
        "record_bytes": len(turns[len(turns) // 2].model_dump_json()),
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "hiredis": importlib.util.find_spec("hiredis") is not None,
    }
    with tempfile.TemporaryDirectory() as tmp, EmbeddedValkey(Path(tmp)) as valkey:
        for processes in (1, 2):
            report[f"processes_{processes}"] = run_case(valkey, turns, fbs, processes)
    report["target_turns_per_s_1_process"] = 2000
    report["meets_target"] = report["processes_1"].get("turns_per_s", 0) >= 2000
    print(json.dumps(report))


if __name__ == "__main__":
    main()

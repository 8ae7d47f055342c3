"""Collector and trainer as real `liveloop` processes: 64 judged turns become a live version."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis.asyncio as aredis

from liveloop import bus
from liveloop.contracts import WeightsAnnouncement
from tests.test_collector_support import publish_turns, scored_turn

ROOT = Path(__file__).resolve().parents[1]


def start_loop(command: str, redis_url: str, data_dir: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "liveloop.cli", command, "--model", "tiny-random"]
    args += ["--redis-url", redis_url, "--data-dir", str(data_dir), "--log-level", "WARNING"]
    return subprocess.Popen(args, cwd=ROOT, env=env, stderr=subprocess.PIPE)


def stop(proc: subprocess.Popen[bytes]) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _out, err = proc.communicate()
    return proc.returncode, err.decode(errors="replace")[-2000:]


async def test_new_version_within_60s_of_64_judged_turns(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    turns = [
        scored_turn(
            f"user{i}",
            prompt_len=60 + (i * 37) % 200,
            completion_len=10 + (i * 53) % 120,
            score=((i % 5) - 2) / 2,
        )
        for i in range(64)
    ]
    await publish_turns(aredis_client, turns)
    start = time.monotonic()
    procs = [start_loop(cmd, redis_url, data_dir) for cmd in ("collect", "train")]
    try:
        announced: WeightsAnnouncement | None = None
        while announced is None and time.monotonic() - start < 60:
            assert all(p.poll() is None for p in procs), [stop(p) for p in procs]
            entries = await aredis_client.xrange("liveloop:weights", count=1)
            if entries:
                announced = bus.decode(entries[0][1], WeightsAnnouncement)
            await asyncio.sleep(0.2)
        elapsed = time.monotonic() - start
    finally:
        results = [stop(p) for p in procs]
    assert announced is not None, f"no new version within 60 s: {results}"
    assert announced.version == 1 and elapsed < 60
    assert Path(announced.path, "model.safetensors").is_file()
    assert announced.metrics["samples"] > 0
    # SIGTERM is a clean stop for both loops.
    assert [rc for rc, _err in results] == [0, 0], results

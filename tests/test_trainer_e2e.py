"""Collector and trainer as real `liveloop` processes: 64 judged turns become a live version."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis.asyncio as aredis

from liveloop import bus
from liveloop.contracts import WeightsAnnouncement
from liveloop.valkey import free_port
from tests.conftest import wait_for
from tests.test_collector_support import publish_turns, scored_turn

ROOT = Path(__file__).resolve().parents[1]


def start_loop(
    command: str, redis_url: str, data_dir: Path, metrics_port: int
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "liveloop.cli", command, "--model", "tiny-random"]
    args += ["--redis-url", redis_url, "--data-dir", str(data_dir), "--log-level", "WARNING"]
    args += ["--metrics-port", str(metrics_port)]
    return subprocess.Popen(args, cwd=ROOT, env=env, stderr=subprocess.PIPE)


def scrape(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text


def value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not exported")


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
    ports = {"collect": free_port(), "train": free_port()}
    procs = [start_loop(cmd, redis_url, data_dir, port) for cmd, port in ports.items()]
    try:
        announced: WeightsAnnouncement | None = None
        while announced is None and time.monotonic() - start < 60:
            assert all(p.poll() is None for p in procs), [stop(p) for p in procs]
            entries = await aredis_client.xrange("liveloop:weights", count=1)
            if entries:
                announced = bus.decode(entries[0][1], WeightsAnnouncement)
            await asyncio.sleep(0.2)
        elapsed = time.monotonic() - start
        if announced is not None:  # the gauges are set a moment after the announcement

            def trainer_version() -> float:
                return value(scrape(ports["train"]), "liveloop_trainer_version")

            await wait_for(lambda: trainer_version() >= 1, 15, 0.1, "the version gauge")
        scraped = {cmd: scrape(port) for cmd, port in ports.items()}
    finally:
        results = [stop(p) for p in procs]
    assert announced is not None, f"no new version within 60 s: {results}"
    assert announced.version == 1 and elapsed < 60
    assert Path(announced.path, "model.safetensors").is_file()
    assert announced.metrics["samples"] > 0
    assert value(scraped["train"], "liveloop_trainer_version") >= 1
    for name in ("loss", "clip_fraction", "iw_mean", "iw_max", "iw_capped_fraction", "entropy"):
        assert f"liveloop_trainer_{name} " in scraped["train"], name
    for name in ("approx_kl", "grad_norm", "tokens_per_second", "staleness_bucket"):
        assert f"liveloop_trainer_{name}" in scraped["train"], name
    assert value(scraped["train"], "liveloop_trainer_batch_wait_seconds_count") >= 1
    assert value(scraped["collect"], "liveloop_collector_turns_total") == 64
    assert value(scraped["collect"], 'liveloop_collector_reward_count{version="0"}') == 64
    assert value(scraped["collect"], "liveloop_collector_batch_wait_seconds_count") >= 1
    # SIGTERM is a clean stop for both loops.
    assert [rc for rc, _err in results] == [0, 0], results

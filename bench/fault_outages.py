"""Outages: the server SIGKILLed while Redis is down, and Redis down for a while under load.

Why: a reply a client received must reach `liveloop:turns` exactly once whatever fails
around it. `run_server_crash` stops Redis, serves traffic (turns go to the fsynced spool),
SIGKILLs the server in the middle of a stream, leaves a garbled tail on the spool (what a
crash during a write leaves), brings Redis and the server back and counts. `run_redis_outage`
stops Redis for `outage_s` under steady load and brings it back from its AOF or empty (data
lost), then counts failed requests, lost, duplicated and out-of-order turns, and checks that
the loops recreated their consumer groups and went on judging.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.audit import audit_judging, audit_turns
from bench.fault_killers import CONFIG
from bench.fleet import Fleet
from bench.traffic import Served, Traffic, latency_summary

GARBLED_TAIL = b'{"session_id": "torn-by-a-crash", "turn_ind' + b"\x00" * 64


def metric(text: str, series: str) -> float:
    """A sample's value in a Prometheus exposition (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


async def _traffic_for(traffic: Traffic, seconds: float) -> list[Served]:
    stop = asyncio.Event()
    task = asyncio.create_task(traffic.run(stop))
    await asyncio.sleep(seconds)
    stop.set()
    return await task


async def _kill_mid_stream(fleet: Fleet, traffic: Traffic, seconds: float) -> dict[str, Any]:
    """Traffic for `seconds`, then SIGKILL the server while a long stream is being read."""
    stop = asyncio.Event()
    task = asyncio.create_task(traffic.run(stop))
    await asyncio.sleep(seconds)
    body = {
        "model": "tiny-random",
        "messages": [{"role": "user", "content": "a long story"}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    chunks = 0
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", fleet.base_url + "/v1/chat/completions", json=body) as response,
    ):
        try:
            async for _line in response.aiter_lines():
                chunks += 1
                if chunks == 20:  # mid-stream: tokens are flowing
                    fleet.kill("serve", "mid-stream")
        except httpx.HTTPError:
            pass
    stop.set()
    await task
    return {"chunks_before_kill": chunks}


def wait_metric(url: str, series: str, done: Any, timeout_s: float) -> float:
    """Poll a metric until `done(value)`; its last value."""
    deadline = time.monotonic() + timeout_s
    value = 0.0
    while time.monotonic() < deadline:
        try:
            value = metric(httpx.get(url, timeout=5).text, series)
        except httpx.HTTPError:
            value = 0.0
        if done(value):
            break
        time.sleep(0.2)
    return value


def run_server_crash(root: Path, *, seconds: float = 4.0, agents: int = 3) -> dict[str, Any]:
    """Redis down, traffic spooled, server SIGKILLed mid-stream, garbled spool tail; recover."""
    fleet = Fleet(root, {"server": {"default_max_tokens": 8}}, loops=("serve",))
    fleet.start()
    try:
        traffic = Traffic(fleet.base_url, agents=agents, max_tokens=8)
        asyncio.run(_traffic_for(traffic, 1.0))  # some turns written while Redis is up
        fleet.valkey.stop()
        during = Traffic(fleet.base_url, agents=agents, max_tokens=8, run_id=traffic.run_id + "d")
        kill = asyncio.run(_kill_mid_stream(fleet, during, seconds))
        spool = fleet.data_dir / "spool" / "turns.spool"
        spooled_lines = spool.read_bytes().count(b"\n") if spool.exists() else 0
        with open(spool, "ab") as fh:  # a crash during a write: torn and zero-filled
            fh.write(GARBLED_TAIL)
        fleet.start_valkey()
        fleet.start_loop("serve")
        fleet.wait_ready()
        metrics_url = fleet.base_url + "/metrics"
        wait_metric(metrics_url, "liveloop_trace_spool_backlog", lambda v: v == 0, 60)
        text = httpx.get(metrics_url, timeout=5).text
    finally:
        fleet.stop()
    fleet.start_valkey()
    client = redis.Redis.from_url(fleet.redis_url, decode_responses=True)
    try:
        served = traffic.served + during.served
        turns = audit_turns(client, served)
    finally:
        client.close()
        fleet.valkey.stop()
    outage = latency_summary(during.served)
    return {
        "scenario": "server_crash",
        "requests_while_redis_down": outage["requests"],
        "completed_while_redis_down": sum(1 for s in during.served if s.ok),
        "killed_in_flight": outage["failed"],
        "spooled_before_kill": spooled_lines,
        "replayed": metric(text, 'liveloop_trace_records_total{outcome="replayed"}'),
        "quarantined": metric(text, 'liveloop_trace_records_total{outcome="quarantined"}'),
        "torn_tails": metric(text, "liveloop_trace_spool_torn_tails_total"),
        "turns_served": turns["served"],
        "lost": turns["lost"],
        "duplicated": turns["duplicated"],
        "sessions_out_of_order": turns["sessions_out_of_order"],
        **kill,
    }


async def _outage(
    fleet: Fleet, traffic: Traffic, warm_s: float, outage_s: float, after_s: float, wipe: bool
) -> tuple[float, float]:
    stop = asyncio.Event()
    task = asyncio.create_task(traffic.run(stop))
    await asyncio.sleep(warm_s)
    down_at = time.perf_counter()
    await asyncio.to_thread(fleet.valkey.stop)
    traffic.marks["stopped"] = time.perf_counter()
    await asyncio.sleep(outage_s)
    if wipe:  # Redis came back without its data
        shutil.rmtree(fleet.valkey.data_dir, ignore_errors=True)
    await asyncio.to_thread(fleet.start_valkey)
    up_at = time.perf_counter()
    await asyncio.sleep(after_s)
    stop.set()
    await task
    return down_at, up_at


def run_redis_outage(
    root: Path,
    *,
    outage_s: float = 30.0,
    modes: tuple[str, ...] = ("aof", "empty"),
    agents: int = 3,
    loops: tuple[str, ...] = ("serve", "judge", "collect"),
) -> list[dict[str, Any]]:
    """Stop Redis for `outage_s` under steady load, once per mode: back from its AOF
    ('aof') or without its data ('empty'); one dict of figures per mode."""
    fleet = Fleet(root, CONFIG, loops=loops)
    fleet.start()
    results = []
    try:
        for i, mode in enumerate(modes):
            traffic = Traffic(fleet.base_url, agents=agents, max_tokens=8, seed=i)
            down, up = asyncio.run(_outage(fleet, traffic, 2.0, outage_s, 3.0, mode == "empty"))
            results.append(_count_outage(fleet, traffic, mode, down, up, loops))
    finally:
        codes = fleet.stop()
    for figures in results:
        figures["exit_codes"] = codes
    return results


def _count_outage(
    fleet: Fleet, traffic: Traffic, mode: str, down: float, up: float, loops: tuple[str, ...]
) -> dict[str, Any]:
    metrics_url = fleet.base_url + "/metrics"
    wait_metric(metrics_url, "liveloop_trace_spool_backlog", lambda v: v == 0, 60)
    # Redis restarted empty lost what it held, the records of requests that began before it
    # had stopped included; everything asked for from then on must be there.
    stopped = traffic.marks["stopped"]
    served = traffic.served if mode == "aof" else [s for s in traffic.served if s.started > stopped]
    client = redis.Redis.from_url(fleet.redis_url, decode_responses=True)
    try:
        judged = _wait_judged(client, served, 60.0) if "judge" in loops else {}
        turns = audit_turns(client, served)
        streams = ["turns", "scored"] + (["batches"] if "train" in loops else [])
        groups = {s: _group_names(client, s, 30.0) for s in streams}
    finally:
        client.close()
    in_outage = [s for s in traffic.served if s.started < up and s.ended > down]
    return {
        "scenario": f"redis_outage_{mode}",
        "outage_s": round(up - down, 1),
        "requests": len(traffic.served),
        "requests_during_outage": len(in_outage),
        "failed": sum(1 for s in traffic.served if not s.ok),
        "turns_counted": turns["served"],
        "turns_lost": turns["lost"],
        "duplicated": turns["duplicated"],
        "sessions_out_of_order": turns["sessions_out_of_order"],
        "judged_after_recovery": judged.get("judged_once"),
        "unjudged": judged.get("unjudged"),
        "consumer_groups": groups,
        "latency_during_outage": latency_summary(in_outage),
    }


def _group_names(client: redis.Redis, stream: str, timeout_s: float) -> list[str]:
    """The consumer groups of a stream, waiting (bounded) until it has one."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            groups: Any = client.xinfo_groups(f"liveloop:{stream}")
        except redis.ResponseError:  # no such stream yet
            groups = []
        if groups or time.monotonic() > deadline:
            return sorted(g["name"] for g in groups)
        time.sleep(0.2)


def _wait_judged(client: redis.Redis, served: list[Served], timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        judged = audit_judging(client, audit_turns(client, served)["trainable"])
        if judged["unjudged"] == 0 or time.monotonic() > deadline:
            return judged
        time.sleep(0.5)

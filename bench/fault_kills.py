"""Crash campaign: SIGKILL the judge, the collector and the trainer while traffic flows.

Why: each loop claims to lose nothing and do nothing twice across crashes (consumer groups,
acks after durable output, dedupe markers, checkpoints with optimizer state). This drives
a `Fleet` with simulated agents and, from one thread per loop, kills that loop again and
again and restarts it at once, as a supervisor would. Some kills are aimed: the trainer
while a checkpoint is being written (its temporary directory exists), the collector while a
batch is being written (its batch file appears; batches go by reference for this), and a
kill only counts as aimed when the evidence is there afterwards (the half-written directory
left behind; the batch's turns still unacknowledged). After the traffic stops and the loops
drain, everything is counted by `bench/audit.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import redis

from bench.audit import audit_batches, audit_judging, audit_trainer, audit_turns
from bench.fault_killers import CONFIG, Killer, Watcher, stream_groups
from bench.fleet import Fleet
from bench.traffic import Traffic


def campaign_state(fleet: Fleet, killers: list[Killer]) -> dict[str, Any]:
    """Kills so far (by loop and by aim) and trainer restarts that resumed a checkpoint."""
    aimed = [a for k in killers for a in k.aimed]
    return {
        "kills": {name: len(loop.kills) for name, loop in fleet.loops.items()},
        "aimed": {a: aimed.count(a) for a in sorted(set(aimed))},
        "resumed": fleet.log_tail("train", 10**7).count("resumed from checkpoint"),
    }


def goal_reached(state: dict[str, Any], min_kills: int) -> bool:
    """At least `min_kills` kills, one of them during a checkpoint write, one during a batch
    write, and one trainer restart after a checkpoint existed."""
    aimed: dict[str, int] = state["aimed"]
    return bool(
        sum(state["kills"].values()) >= min_kills
        and aimed.get("checkpoint", 0) >= 1
        and aimed.get("batch", 0) >= 1
        and state["resumed"] >= 1
    )


def progress(stage: str, started: float, **figures: Any) -> None:
    """One line on stderr, so that a run cut short (a test's timeout) shows how far it got."""
    line = {"stage": stage, "s": round(time.monotonic() - started), **figures}
    print(json.dumps(line), file=sys.stderr, flush=True)


def thaw_frozen(fleet: Fleet) -> list[str]:
    """Loops still frozen (SIGSTOP) once the killers are done: every freeze should have ended
    in a kill. Each is killed and restarted so that the drain can go on; their names."""
    frozen = []
    for name, loop in fleet.loops.items():
        with contextlib.suppress(psutil.Error):
            if loop.alive and psutil.Process(loop.pid).status() == psutil.STATUS_STOPPED:
                fleet.kill(name, "left frozen")
                fleet.start_loop(name)
                frozen.append(name)
    return frozen


def collector_backlog(client: redis.Redis) -> int:
    """Judged turns the collector has not batched yet: unread plus read but unacknowledged."""
    group = next((g for g in stream_groups(client, "scored") if g["name"] == "collector"), {})
    return int(group.get("lag") or 0) + int(group.get("pending") or 0)


def hold_back(flowing: asyncio.Event, client: redis.Redis, max_backlog: int) -> int:
    """Hold the agents back (clear `flowing`) while more than `max_backlog` judged turns wait
    for the collector (it and the trainer are slowed by the kills, the agents are not:
    unchecked, a long campaign served more turns than the loops could drain in time); the
    backlog."""
    backlog = collector_backlog(client)
    if backlog > max_backlog:
        flowing.clear()
    else:
        flowing.set()
    return backlog


async def _drive(
    fleet: Fleet,
    traffic: Traffic,
    killers: list[Killer],
    seconds: float,
    min_kills: int,
    max_seconds: float,
    max_backlog: int,
) -> float:
    """Traffic and kills for `seconds`, then on until the goal (or `max_seconds`)."""
    stop = asyncio.Event()
    flowing = traffic.flowing = asyncio.Event()
    flowing.set()
    client = redis.Redis.from_url(fleet.redis_url, decode_responses=True)
    started = time.monotonic()
    reported = started + seconds
    task = asyncio.create_task(traffic.run(stop))
    threads = [threading.Thread(target=k.run, daemon=True, name=k.loop) for k in killers]
    for t in threads:
        t.start()
    try:
        while time.monotonic() - started < max_seconds:
            backlog = hold_back(flowing, client, max_backlog)
            if time.monotonic() - started >= seconds:  # the goal is only looked at from then
                state = campaign_state(fleet, killers)
                if goal_reached(state, min_kills):
                    break
                if time.monotonic() - reported > 30:
                    progress("kills", started, served=len(traffic.served), backlog=backlog, **state)
                    reported = time.monotonic()
            await asyncio.sleep(0.5)
    finally:
        client.close()
    for k in killers:
        k.stop.set()
    stop.set()
    flowing.set()  # agents held back see the stop
    await task
    for t in threads:
        await asyncio.to_thread(t.join)
    return time.monotonic() - started


def drain(fleet: Fleet, served: list[Any], timeout_s: float) -> float:
    """Wait until every served trainable turn is judged, batched and trained; seconds taken."""
    client = redis.Redis.from_url(fleet.redis_url, decode_responses=True)
    start = reported = time.monotonic()
    try:
        while time.monotonic() - start < timeout_s:
            for name, loop in fleet.loops.items():
                if not loop.alive:
                    fleet.start_loop(name)  # a loop that died on its own is restarted too
            trainable = audit_turns(client, served)["trainable"]
            judged = audit_judging(client, trainable)
            groups = {g["name"]: g for s in ("scored", "batches") for g in stream_groups(client, s)}
            idle = all(
                int(groups.get(n, {}).get("pending", 1)) == 0
                and int(groups.get(n, {}).get("lag") or 0) == 0
                for n in ("collector", "trainer")
            )
            if judged["unjudged"] == 0 and idle:
                return time.monotonic() - start
            if time.monotonic() - reported > 30:
                lag = {n: (g.get("pending"), g.get("lag")) for n, g in groups.items()}
                progress("drain", start, unjudged=judged["unjudged"], pending_lag=lag)
                reported = time.monotonic()
            time.sleep(0.5)
        return time.monotonic() - start
    finally:
        client.close()


def run_campaign(
    root: Path,
    *,
    seconds: float = 60.0,
    min_kills: int = 20,
    max_seconds: float = 600.0,
    agents: int = 3,
    every_s: dict[str, float] | None = None,
    seed: int = 0,
    drain_timeout_s: float = 180.0,
    max_backlog: int = 300,
) -> dict[str, Any]:
    """Traffic for `seconds` (then on until `min_kills` kills and both aimed kinds, within
    `max_seconds`) while judge, collector and trainer are killed, held back while more than
    `max_backlog` judged turns wait for the collector; the figures."""
    every = every_s or {"judge": 2.0, "collect": 2.0, "train": 3.0}
    fleet = Fleet(root, CONFIG)
    watcher = Watcher(fleet, root / "batch-archive")
    rng = random.Random(seed)
    fleet.start()
    try:
        watcher.start()
        stop = threading.Event()
        killers = [
            Killer(fleet, watcher, name, every[name], random.Random(rng.random()), stop)
            for name in every
        ]
        traffic = Traffic(fleet.base_url, agents=agents, max_tokens=8, seed=seed)
        traffic_s = asyncio.run(
            _drive(fleet, traffic, killers, seconds, min_kills, max_seconds, max_backlog)
        )
        frozen = thaw_frozen(fleet)
        drained_s = drain(fleet, traffic.served, drain_timeout_s)
    finally:
        watcher.stop.set()
        codes = fleet.stop()
    fleet.start_valkey()  # the AOF brings the streams back for counting
    client = redis.Redis.from_url(fleet.redis_url, decode_responses=True)
    try:
        figures = _figures(fleet, traffic, killers, client, watcher, drained_s, codes)
        return {**figures, "traffic_s": round(traffic_s, 1), "loops_left_frozen": frozen}
    finally:
        client.close()
        fleet.valkey.stop()


def _baseline_count(client: redis.Redis) -> int:
    """Scores folded into the stored `rules` baseline: all of them if it survived restarts."""
    raw: Any = client.hget("liveloop:collector:baselines", "rules")
    return int(json.loads(raw)["count"]) if raw else 0


def _figures(
    fleet: Fleet,
    traffic: Traffic,
    killers: list[Killer],
    client: redis.Redis,
    watcher: Watcher,
    drained_s: float,
    codes: dict[str, int | None],
) -> dict[str, Any]:
    turns = audit_turns(client, traffic.served)
    judging = audit_judging(client, turns.pop("trainable"))
    batches = audit_batches(client, fleet.data_dir, watcher.archive)
    trainer = audit_trainer(client, fleet.checkpoints_dir, batches.pop("batch_ids"))
    aimed = [a for k in killers for a in k.aimed]
    resumed = fleet.log_tail("train", 10**7).count("resumed from checkpoint")
    return {
        "scenario": "loop_kills",
        "kills": sum(len(loop.kills) for loop in fleet.loops.values()),
        "kills_by_loop": {name: len(loop.kills) for name, loop in fleet.loops.items()},
        "kills_during_checkpoint_write": aimed.count("checkpoint"),
        "kills_during_batch_write": aimed.count("batch"),
        "aimed_kills_missed": aimed.count("missed"),
        "aimed_kills_without_a_write": aimed.count("random"),  # none came within 30 s
        "requests": len(traffic.served),
        "requests_failed": sum(1 for s in traffic.served if not s.ok),
        "turns_served": turns["served"],
        "judged": judging["judged_once"],
        "lost": turns["lost"] + judging["unjudged"],
        "duplicated": turns["duplicated"]
        + judging["judged_twice_or_more"]
        + batches["turns_in_two_batches"]
        + trainer["batches_trained_twice"],
        "turns": turns,
        "judging": judging,
        "batches": batches,
        "trainer": {**trainer, "restarts_resumed_from_checkpoint": resumed},
        "baseline_scores_folded": _baseline_count(client),
        "drain_s": round(drained_s, 1),
        "exit_codes": codes,
    }

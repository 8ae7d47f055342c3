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
import os
import random
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis

from bench.audit import audit_batches, audit_judging, audit_trainer, audit_turns
from bench.fleet import Fleet
from bench.traffic import Traffic

# Fast loops with fixed consumer names: a restarted loop takes its own pending entries back
# at once (as a StatefulSet pod would), instead of waiting for a reclaim timeout.
CONFIG: dict[str, Any] = {
    "prm": {
        "next_state_timeout_s": 2.0,
        "consumer": {"name": "judge-0", "claim_idle_ms": 2000},
        "sweep_interval_s": 0.2,
        "rules": {"timeout_score": 0.0},  # every turn gets a score, silence included
    },
    "collector": {
        "min_turns": 4,
        "max_wait_s": 1.0,
        "group_wait_s": 0.2,
        "consumer": {"name": "collector-0", "claim_idle_ms": 5000},
        "inline_max_bytes": 1024,  # batches by reference: a batch write takes a file write
        # a few batches may wait for the trainer, which is killed and restarted all the
        # while: with one, publishing stalls whenever the trainer is down
        "max_queued_batches": 4,
    },
    "max_staleness": 1_000_000,  # every judged turn must reach a batch
    "trainer": {
        "consumer": {"name": "trainer-0", "claim_idle_ms": 5000},
        "read_block_ms": 200,
        "keep_checkpoints": 3,
        "minibatches": 1,
        "gate": {"enabled": False},  # the promotion gate's probes are not under test here
        # nor is the served-quality watch: a rollback publishes a version without a batch
        # (and rewinds the optimizer), which the one-batch-per-version audit would miscount
        "watch": {"enabled": False},
    },
    "server": {"default_max_tokens": 8},
}


class Watcher(threading.Thread):
    """Polls the data dir every ~2 ms: copies batch files (the trainer deletes them once
    trained) and, when armed, freezes a loop (SIGSTOP) the moment it is seen writing a
    checkpoint or a batch, so that the kill lands exactly there."""

    def __init__(self, fleet: Fleet, archive: Path) -> None:
        super().__init__(daemon=True, name="watcher")
        self.fleet = fleet
        self.archive = archive
        self.batch_dir = fleet.data_dir / "batches"
        self.stop = threading.Event()
        # one armed freeze per kind of write, so that the trainer's killer and the
        # collector's killer never replace each other's (a replaced arm left a frozen
        # loop unkilled, or made the aim wait its whole deadline)
        self.caught = {what: threading.Event() for what in ("checkpoint", "batch")}
        self.last_batch: Path | None = None
        self._armed: dict[str, int] = {}  # what -> pid
        self._lock = threading.Lock()
        self._seen: set[str] = set()

    def arm(self, what: str, pid: int) -> None:
        """Freeze `pid` the next time it writes `what` ('checkpoint' or 'batch')."""
        with self._lock:
            self.caught[what].clear()
            self._armed[what] = pid

    def disarm(self, what: str) -> None:
        """Forget the armed freeze of `what`."""
        with self._lock:
            self._armed.pop(what, None)

    def _freeze(self, what: str) -> None:
        with self._lock:
            pid = self._armed.pop(what, None)
            if pid is None:
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
            self.caught[what].set()

    def run(self) -> None:
        self.archive.mkdir(parents=True, exist_ok=True)
        while not self.stop.is_set():
            trainer = self.fleet.loops["train"].pid
            if trainer and any(self.fleet.checkpoints_dir.glob(f".v*.tmp-{trainer}")):
                self._freeze("checkpoint")
            for path in self.batch_dir.glob("*") if self.batch_dir.is_dir() else []:
                if path.name in self._seen:
                    continue
                if ".tmp-" in path.name:
                    self._freeze("batch")
                    continue
                self._seen.add(path.name)
                self.last_batch = path
                self._freeze("batch")
                try:  # whole or not at all: a killer may read the copy at once
                    part = self.archive / f"{path.name}.part"
                    shutil.copy(path, part)
                    part.replace(self.archive / path.name)
                except OSError:
                    self._seen.discard(path.name)  # half-renamed: try again
            time.sleep(0.002)


GROUPS = {
    "judge": ("turns", "prm"),
    "collect": ("scored", "collector"),
    "train": ("batches", "trainer"),
}


def consumer_idle_ms(client: redis.Redis, loop: str) -> int | None:
    """How long ago the loop's consumer last read its stream (None: it never did)."""
    stream, group = GROUPS[loop]
    try:
        consumers: Any = client.xinfo_consumers(f"liveloop:{stream}", group)
    except redis.ResponseError:
        return None
    section = CONFIG[{"judge": "prm", "collect": "collector", "train": "trainer"}[loop]]
    name = section["consumer"]["name"]
    return next((int(c["idle"]) for c in consumers if c["name"] == name), None)


@dataclass
class Killer:
    """Kills one loop again and again, each time some seconds after it is up and reading;
    every other kill is aimed (a checkpoint or a batch being written) where possible."""

    fleet: Fleet
    watcher: Watcher
    loop: str
    every_s: float
    rng: random.Random
    stop: threading.Event
    aimed: list[str] = field(default_factory=list)
    kills: int = 0

    def run(self) -> None:
        client = redis.Redis.from_url(self.fleet.redis_url, decode_responses=True)
        try:
            while not self.stop.is_set():
                if not self._wait_up(client):
                    return
                if self.stop.wait(self.rng.uniform(0.5, 1.5) * self.every_s):
                    return
                aim = self.loop in ("train", "collect") and (
                    self.kills % 2 == 0 or not self._landed()  # every kill until one lands
                )
                phase = self._aim(client) if aim else "random"
                if phase is None:
                    return  # stopped while waiting for a write to aim at
                self.fleet.kill(self.loop, phase)
                if aim:
                    self.aimed.append(phase)
                self.kills += 1
                self.fleet.start_loop(self.loop)
        finally:
            client.close()

    def _wait_up(self, client: redis.Redis) -> bool:
        """Wait until the restarted loop has read its stream (it is up); False if stopped."""
        while not self.stop.is_set():
            idle = consumer_idle_ms(client, self.loop)
            since = (time.monotonic() - self.fleet.loops[self.loop].started_at) * 1000
            if idle is not None and idle < since:
                return True
            self.stop.wait(0.2)
        return False

    def _landed(self) -> bool:
        """Whether a kill of this loop has landed mid-write yet."""
        return any(a in ("checkpoint", "batch") for a in self.aimed)

    def _room_for_a_batch(self, client: redis.Redis) -> bool:
        """Wait (at most 60 s) until fewer batches wait for the trainer than
        `collector.max_queued_batches`: the collector publishes only then, so a write comes
        soon. False if the run stopped meanwhile."""
        deadline = time.monotonic() + 60.0
        while not self.stop.is_set() and time.monotonic() < deadline:
            trainer = [g for g in _groups(client, "batches") if g["name"] == "trainer"]
            queued = CONFIG["collector"]["max_queued_batches"]
            if trainer and int(trainer[0].get("lag") or 0) < queued:
                return True
            self.stop.wait(0.2)
        return not self.stop.is_set()

    def _aim(self, client: redis.Redis) -> str | None:
        """Freeze the loop mid-write (bounded wait): 'checkpoint'/'batch', 'missed' if the
        evidence is not there once it is frozen, 'random' if no write came in time, None
        if the run stopped meanwhile (no kill then)."""
        what = "checkpoint" if self.loop == "train" else "batch"
        if what == "batch" and not self._room_for_a_batch(client):
            return None
        pid = self.fleet.loops[self.loop].pid
        self.watcher.arm(what, pid)
        caught = self.watcher.caught[what]
        deadline = time.monotonic() + 30.0
        while not caught.wait(0.2):
            if self.stop.is_set() or time.monotonic() > deadline:
                self.watcher.disarm(what)
                if caught.is_set():
                    break  # frozen just now: it must be killed (or it would stay frozen)
                return None if self.stop.is_set() else "random"
        if what == "checkpoint":
            return what if any(self.fleet.checkpoints_dir.glob(f".v*.tmp-{pid}")) else "missed"
        return what if self._batch_unacked(client) else "missed"

    def _batch_unacked(self, client: redis.Redis) -> bool:
        """True if the batch being written is partial or a turn of it is unacknowledged."""
        if any(self.fleet.data_dir.glob("batches/*.tmp-*")):
            return True  # frozen in the middle of writing the batch file
        path = self.watcher.last_batch
        copy = self.watcher.archive / path.name if path is not None else None
        if copy is None or not copy.is_file():
            return False
        keys = {s["key"] for s in json.loads(copy.read_bytes())["samples"]}
        pending: Any = client.xpending_range("liveloop:scored", "collector", "-", "+", 100_000)
        ids = {p["message_id"] for p in pending}
        raw: Any = client.xrange("liveloop:scored")
        for entry_id, fields in raw:
            record = json.loads(fields["data"])
            key = f"{record['session_id']}:{record['turn_index']}:{record.get('sample_index', 0)}"
            if key in keys and entry_id in ids:
                return True
        return False


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


async def _drive(
    fleet: Fleet,
    traffic: Traffic,
    killers: list[Killer],
    seconds: float,
    min_kills: int,
    max_seconds: float,
) -> float:
    """Traffic and kills for `seconds`, then on until the goal (or `max_seconds`)."""
    stop = asyncio.Event()
    started = time.monotonic()
    task = asyncio.create_task(traffic.run(stop))
    threads = [threading.Thread(target=k.run, daemon=True, name=k.loop) for k in killers]
    for t in threads:
        t.start()
    await asyncio.sleep(seconds)
    reported = time.monotonic()
    while time.monotonic() - started < max_seconds:
        state = campaign_state(fleet, killers)
        if goal_reached(state, min_kills):
            break
        if time.monotonic() - reported > 30:
            progress("kills", started, served=len(traffic.served), **state)
            reported = time.monotonic()
        await asyncio.sleep(0.5)
    for k in killers:
        k.stop.set()
    stop.set()
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
            groups = {g["name"]: g for s in ("scored", "batches") for g in _groups(client, s)}
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


def _groups(client: redis.Redis, stream: str) -> list[dict[str, Any]]:
    try:
        return list(client.xinfo_groups(f"liveloop:{stream}"))  # type: ignore[arg-type]
    except redis.ResponseError:
        return []


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
) -> dict[str, Any]:
    """Traffic for `seconds` (then on until `min_kills` kills and both aimed kinds, within
    `max_seconds`) while judge, collector and trainer are killed; the figures."""
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
        traffic_s = asyncio.run(_drive(fleet, traffic, killers, seconds, min_kills, max_seconds))
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

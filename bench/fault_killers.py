"""The crash campaign's killers: one thread per loop that kills it again and again, and a
watcher that freezes a loop mid-write so that an aimed kill lands exactly there.

Kept apart from the campaign (`bench.fault_kills`), which drives traffic, runs these and
audits the streams afterwards; `CONFIG` is the loops' settings for both.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench.fleet import Fleet

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


def stream_groups(client: redis.Redis, stream: str) -> list[dict[str, Any]]:
    """The consumer groups of `liveloop:<stream>` (none while the stream does not exist)."""
    try:
        return list(client.xinfo_groups(f"liveloop:{stream}"))  # type: ignore[arg-type]
    except redis.ResponseError:
        return []


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
            trainer = [g for g in stream_groups(client, "batches") if g["name"] == "trainer"]
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

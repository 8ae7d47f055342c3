"""Pacing simulated users by the trainer, so that objectives are compared per judged turn."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis

from liveloop import bus


class Pacer:
    """Holds simulated users back so that every version is trained on the same turn count.

    Free-running users produce turns as fast as the server answers, and how many judged
    turns one policy version sees then depends on how fast the trainer is. Paced users wait
    before each request while the judged turns number `per_update` x (published versions
    + 1) or more, so every objective gets one update per `per_update` judged turns, however
    fast or slow its updates are (a wait ends after `max_wait_s` in any case). Users also go
    on while the trainer has no batch to read or in hand: a batch it dropped whole (every
    sample stale or flat, or fewer than `trainer.min_update_samples` left) makes no
    version, and waiting for one then would wait for nothing.
    """

    def __init__(self, client: Any, per_update: int, max_wait_s: float = 600.0) -> None:
        self.client = client
        self.per_update = per_update
        self.max_wait_s = max_wait_s
        self.waits = 0  # waits that ran out (no version came)

    def allowed(self) -> bool:
        """True while the judged turns are below the current version's share, or the
        trainer has no batch left to train."""
        judged = int(self.client.xlen(bus.stream_key(bus.SCORED)))
        versions = int(self.client.xlen(bus.stream_key(bus.WEIGHTS)))
        return judged < self.per_update * (versions + 1) or self.trainer_idle()

    def trainer_idle(self) -> bool:
        """True when the trainer's group has read and acknowledged every batch written."""
        try:
            groups = self.client.xinfo_groups(bus.stream_key(bus.BATCHES))
        except redis.ResponseError:  # no batch written yet: the stream does not exist
            return False
        for group in groups:
            if group["name"] == bus.TRAINER_GROUP:
                return int(group["pending"]) == 0 and int(group.get("lag") or 0) == 0
        return False  # the trainer has not started reading

    async def wait(self) -> None:
        """Return when a request may go out."""
        deadline = time.monotonic() + self.max_wait_s
        while not await asyncio.to_thread(self.allowed):
            if time.monotonic() > deadline:
                self.waits += 1
                return
            await asyncio.sleep(0.5)

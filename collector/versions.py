"""The trainer's current policy version, as the collector bounds staleness against it.

The newest weights announcement is the truth (`liveloop.weights.latest_announcement`, one
cheap XREVRANGE, re-read every `poll_s`); when there is none, the registry's newest
version; 0 when neither has one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis.asyncio as aredis

from liveloop.weights import latest_announcement


class TrainerVersion:
    """Cached view of the trainer's current version."""

    def __init__(
        self,
        client: aredis.Redis,
        *,
        poll_s: float = 0.2,
        registry_latest: Callable[[], int | None] | None = None,
    ) -> None:
        self.client = client
        self.poll_s = poll_s
        self.registry_latest = registry_latest
        self._value = 0
        self._read_at = float("-inf")

    @property
    def cached(self) -> int:
        """The last value read (0 before the first read)."""
        return self._value

    async def current(self, force: bool = False) -> int:
        """The current version, re-read when older than `poll_s`."""
        now = time.monotonic()
        if not force and now - self._read_at < self.poll_s:
            return self._value
        self._read_at = now
        announced = await latest_announcement(self.client)
        version = announced.version if announced is not None else None
        if version is None and self.registry_latest is not None:
            version = await asyncio.to_thread(self.registry_latest)
        self._value = version or 0
        return self._value

"""The trainer's current policy version, as the collector bounds staleness against it.

The newest entry of `liveloop:weights` is the truth (one cheap XREVRANGE, re-read every
`poll_s`); when the stream is empty, the registry's newest version; 0 when neither has one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aredis
from pydantic import ValidationError

from liveloop import bus
from liveloop.contracts import WeightsAnnouncement

log = logging.getLogger(__name__)


LATEST_SCAN = 16  # newest announcements looked at for the newest servable one


async def latest_announced_version(client: aredis.Redis) -> int | None:
    """Version of the newest servable `liveloop:weights` entry (rejected ones are skipped)."""
    entries: Any = await client.xrevrange(bus.stream_key(bus.WEIGHTS), count=LATEST_SCAN)
    for _id, fields in entries or []:
        try:
            announcement = bus.decode(fields or {}, WeightsAnnouncement)
        except (ValidationError, ValueError) as exc:
            log.warning("unreadable weights announcement %s: %s", _id, exc)
            continue
        if announcement.servable:
            return announcement.version
    return None


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
        version = await latest_announced_version(self.client)
        if version is None and self.registry_latest is not None:
            version = await asyncio.to_thread(self.registry_latest)
        self._value = version or 0
        return self._value

"""Reading `liveloop:weights`: the one reader of weights announcements, newest first.

Entries are decoded through `WeightsAnnouncement`; a malformed one is logged and skipped,
so a bad write never hides the announcements before it. "The latest" is the newest
*servable* version: one the promotion gate rejected is announced (so servers can show the
refusal) but is never the policy version anyone bounds staleness against or serves. Used by
the server's weight follower, the collector (the trainer's version, for staleness), the
live view and the demo.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import redis
import redis.asyncio as aredis

from liveloop.bus import WEIGHTS, decode_entries, stream_key
from liveloop.contracts import WeightsAnnouncement


def weights_stream() -> str:
    """The full key of the weights stream."""
    return stream_key(WEIGHTS)


def _readable(entries: Iterable[Any]) -> Iterator[WeightsAnnouncement]:
    return decode_entries(entries, WeightsAnnouncement)


def decode_announcements(entries: Iterable[Any]) -> list[WeightsAnnouncement]:
    """Announcements of (entry id, fields) pairs, in the given order; malformed ones skipped."""
    return list(_readable(entries))


async def recent_announcements(
    client: aredis.Redis, count: int = 1
) -> tuple[str | None, list[WeightsAnnouncement]]:
    """(id of the newest entry, the newest `count` readable announcements, newest first)."""
    entries: Any = await client.xrevrange(weights_stream(), count=count)
    newest = str(entries[0][0]) if entries else None
    return newest, decode_announcements(entries or [])


def _newest_servable(entries: Any) -> WeightsAnnouncement | None:
    return next((a for a in _readable(entries or []) if a.servable), None)


async def latest_announcement(client: aredis.Redis, scan: int = 16) -> WeightsAnnouncement | None:
    """The newest servable announcement (looking back `scan` entries), or None."""
    return _newest_servable(await client.xrevrange(weights_stream(), count=scan))


def latest_announcement_sync(client: redis.Redis, scan: int = 16) -> WeightsAnnouncement | None:
    """`latest_announcement` for blocking clients (the live view, the demo)."""
    return _newest_servable(client.xrevrange(weights_stream(), count=scan))

"""Redis/Valkey stream helpers shared by the loops.

Stream keys are `liveloop:<name>`, dead letters go to `liveloop:<name>:dlq`. Producers use
`publish` (optionally exactly-once per dedupe key); consumers use `StreamConsumer`, which
resumes its own pending entries after a restart, reclaims entries idle on dead consumers,
counts failed attempts and dead-letters an entry after too many.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
import redis.asyncio as aredis
from pydantic import BaseModel

log = logging.getLogger(__name__)

PREFIX = "liveloop:"
TURNS = "turns"
SCORED = "scored"
BATCHES = "batches"
WEIGHTS = "weights"
FEEDBACK = "feedback"

DEDUPE_TTL_S = 30 * 24 * 3600

M = TypeVar("M", bound=BaseModel)

# SET the dedupe key only if absent, and XADD in the same atomic step.
_PUBLISH_ONCE = """
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[1]) then
  return redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
end
return false
"""


class BusUnavailable(ConnectionError):
    """Redis/Valkey cannot be reached; the message names the URL."""


def stream_key(name: str) -> str:
    """Full key of a stream name (`turns` -> `liveloop:turns`); full keys pass through."""
    return name if name.startswith(PREFIX) else PREFIX + name


def dlq_key(name: str) -> str:
    """Dead-letter twin of a stream."""
    return stream_key(name) + ":dlq"


def dedupe_marker(stream: str, dedupe_key: str) -> str:
    """The key that makes `publish(..., dedupe_key=...)` exactly-once for (stream, key)."""
    return f"{stream_key(stream)}:seen:{dedupe_key}"


def default_consumer_name() -> str:
    """A consumer name unique to this process."""
    return f"{socket.gethostname()}-{os.getpid()}"


def encode(payload: BaseModel, **index: str | int | float) -> dict[str, str]:
    """Stream fields for a payload: `data` (JSON) plus small index fields."""
    fields = {"data": payload.model_dump_json()}
    fields.update({k: str(v) for k, v in index.items()})
    return fields


def decode(fields: Mapping[str, Any], model: type[M]) -> M:
    """Parse the `data` field of an entry into a contract model."""
    raw = fields.get("data") if "data" in fields else fields.get(b"data")  # type: ignore[call-overload]
    if raw is None:
        raise ValueError("stream entry has no 'data' field")
    return model.model_validate_json(raw)


def _describe(url: str) -> str:
    return url.split("@")[-1]


async def connect(url: str) -> aredis.Redis:
    """Connect (async) and ping; raises BusUnavailable with a one-line reason."""
    try:
        client = aredis.from_url(url, decode_responses=True)
        await client.ping()  # type: ignore[misc]
    except (redis.RedisError, OSError, ValueError) as exc:
        raise BusUnavailable(f"cannot reach Redis at {_describe(url)}: {exc}") from None
    return client


def connect_sync(url: str) -> redis.Redis:
    """Connect (blocking) and ping; raises BusUnavailable with a one-line reason."""
    try:
        client = redis.from_url(url, decode_responses=True)
        client.ping()
    except (redis.RedisError, OSError, ValueError) as exc:
        raise BusUnavailable(f"cannot reach Redis at {_describe(url)}: {exc}") from None
    return client


async def publish(
    client: aredis.Redis,
    stream: str,
    payload: BaseModel,
    *,
    dedupe_key: str | None = None,
    **index: str | int | float,
) -> str | None:
    """XADD a payload. With `dedupe_key`, a second publish of the same key is a no-op (None)."""
    fields = encode(payload, **index)
    if dedupe_key is None:
        return str(await client.xadd(stream_key(stream), fields))  # type: ignore[arg-type]
    argv: list[str | int] = [DEDUPE_TTL_S]
    for k, v in fields.items():
        argv += [k, v]
    marker = dedupe_marker(stream, dedupe_key)
    result = await client.eval(_PUBLISH_ONCE, 2, stream_key(stream), marker, *argv)  # type: ignore[misc]
    return str(result) if result else None


@dataclass
class Entry:
    """One stream entry as delivered to a consumer."""

    id: str
    fields: dict[str, str]

    def parse(self, model: type[M]) -> M:
        """The entry's `data` as a contract model."""
        return decode(self.fields, model)


class StreamConsumer:
    """At-least-once consumption of one stream by one member of a consumer group.

    `read()` returns, in order of priority: this consumer's own pending entries (once, after a
    restart), entries idle longer than `claim_idle_ms` on any consumer (dead consumers, and
    our own failed entries: a natural retry backoff), then new entries. The caller acks an
    entry after its output is durably written, or calls `fail()`, which dead-letters the
    entry after `max_attempts`.
    """

    def __init__(
        self,
        client: aredis.Redis,
        stream: str,
        group: str,
        consumer: str | None = None,
        *,
        claim_idle_ms: int = 30_000,
        max_attempts: int = 5,
        count: int = 256,
    ) -> None:
        self.client = client
        self.stream = stream_key(stream)
        self.group = group
        self.consumer = consumer or default_consumer_name()
        self.claim_idle_ms = claim_idle_ms
        self.max_attempts = max_attempts
        self.count = count
        self._attempts_key = f"{self.stream}:attempts:{group}"
        self._resumed = False
        self._claim_cursor = "0-0"

    async def ensure_group(self, start_id: str = "0") -> None:
        """Create the consumer group (and the stream) if missing."""
        try:
            await self.client.xgroup_create(self.stream, self.group, id=start_id, mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, block_ms: int = 1000) -> list[Entry]:
        """Next entries to process (possibly empty after `block_ms`)."""
        if not self._resumed:
            self._resumed = True
            own = await self._read_from("0", block_ms=None)
            if own:
                return own
        claimed = await self._reclaim()
        if claimed:
            return claimed
        return await self._read_from(">", block_ms=block_ms)

    async def _read_from(self, start: str, block_ms: int | None) -> list[Entry]:
        reply: Any = await self.client.xreadgroup(
            self.group, self.consumer, {self.stream: start}, count=self.count, block=block_ms
        )
        entries: list[Entry] = []
        for _stream, items in reply or []:
            for entry_id, fields in items:
                if fields:  # history entries deleted meanwhile come back empty
                    entries.append(Entry(entry_id, dict(fields)))
        return entries

    async def _reclaim(self) -> list[Entry]:
        reply = await self.client.xautoclaim(
            self.stream,
            self.group,
            self.consumer,
            min_idle_time=self.claim_idle_ms,
            start_id=self._claim_cursor,
            count=self.count,
        )
        self._claim_cursor = str(reply[0])
        return [Entry(eid, dict(f)) for eid, f in reply[1] if f]

    async def ack(self, *entry_ids: str) -> None:
        """Acknowledge processed entries and forget their attempt counts."""
        if not entry_ids:
            return
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.xack(self.stream, self.group, *entry_ids)
            pipe.hdel(self._attempts_key, *entry_ids)
            await pipe.execute()

    async def fail(self, entry: Entry, error: str) -> bool:
        """Record a failed attempt; after `max_attempts` dead-letter and ack it. True if dead."""
        attempts = int(await self.client.hincrby(self._attempts_key, entry.id, 1))  # type: ignore[misc]
        if attempts < self.max_attempts:
            log.warning("entry %s failed (attempt %d): %s", entry.id, attempts, error)
            return False
        dead = dict(entry.fields)
        dead.update({"error": error[:2000], "source_id": entry.id, "attempts": str(attempts)})
        await self.client.xadd(self.stream + ":dlq", dead)  # type: ignore[arg-type]
        await self.ack(entry.id)
        log.error("entry %s dead-lettered after %d attempts: %s", entry.id, attempts, error)
        return True

    async def lag(self) -> tuple[int, int]:
        """(entries not yet delivered to the group, entries pending acknowledgement)."""
        groups = await self.client.xinfo_groups(self.stream)
        for g in groups:
            if g["name"] == self.group:
                return int(g.get("lag") or 0), int(g.get("pending") or 0)
        return 0, 0

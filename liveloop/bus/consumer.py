"""At-least-once consumption of a stream by one member of a consumer group.

One consumer for every loop (judging, collecting, training):

- `read()` returns, in order of priority: this consumer's own pending entries (once,
  after a restart), entries idle longer than `claim_idle_ms` on any consumer (dead
  consumers, and our own failed entries), then new entries;
- entries this process is still working on (`in_flight`) are never handed out again by a
  reclaim, and `keep_alive()` resets their idle time so no other consumer reclaims them;
- a failed entry (`fail()`) is retried with exponential backoff: the first retry comes when
  it is reclaimed (after `claim_idle_ms`), each later one waits twice as long, up to
  `backoff_max_s`; after `max_attempts` it goes to the dead-letter stream;
- `dead_letter()` moves an entry there at once (malformed input), optionally as other
  fields (the judging loop dead-letters the turns a job refers to);
- acknowledgements can be queued on a caller's pipeline (`queue_ack`), next to the output
  they confirm.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import redis
import redis.asyncio as aredis
from redis.asyncio.client import Pipeline

from liveloop.bus.codec import Entry
from liveloop.bus.keys import attempts_key, retry_key, stream_key

log = logging.getLogger(__name__)

ERROR_CHARS = 2000  # longest error message kept with a dead letter


def default_consumer_name() -> str:
    """A consumer name unique to this process."""
    return f"{socket.gethostname()}-{os.getpid()}"


class StreamConsumer:
    """At-least-once consumer with in-flight tracking, retry backoff and dead-lettering."""

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
        dead_letter_stream: str | None = None,
        backoff_max_s: float = 300.0,
        delete_acked: bool = False,
    ) -> None:
        self.client = client
        self.stream = stream_key(stream)
        self.group = group
        self.consumer = consumer or default_consumer_name()
        self.claim_idle_ms = claim_idle_ms
        self.max_attempts = max_attempts
        self.count = count
        self.dead_letter_stream = stream_key(dead_letter_stream or self.stream + ":dlq")
        self.backoff_max_s = backoff_max_s
        self.delete_acked = delete_acked
        self.in_flight: set[str] = set()
        self._attempts_key = attempts_key(self.stream, group)
        self._retry_key = retry_key(self.stream, group)
        self._resumed = False
        self._claim_cursor = "0-0"

    def restart(self) -> None:
        """Read this consumer's own pending entries again first, as after a restart."""
        self._resumed, self._claim_cursor = False, "0-0"

    async def ensure_group(self, start_id: str = "0") -> None:
        """Create the consumer group (and the stream) if missing."""
        try:
            await self.client.xgroup_create(self.stream, self.group, id=start_id, mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, block_ms: int = 1000) -> list[Entry]:
        """Next entries to process (possibly empty after `block_ms`).

        A group that vanished (Redis restarted without its data) is created again, reading
        the stream from its start, and the read returns nothing this time.
        """
        try:
            return await self._read(block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning(
                "consumer group %s of %s is gone (Redis lost its data?); creating it again",
                self.group,
                self.stream,
            )
            await self.ensure_group("0")
            self.restart()
            return []

    async def _read(self, block_ms: int) -> list[Entry]:
        if not self._resumed:
            self._resumed = True
            own = await self._due(await self._read_from("0", block_ms=None))
            if own:
                return own
        claimed = await self._due(await self._reclaim())
        if claimed:
            return claimed
        return [
            e for e in await self._read_from(">", block_ms=block_ms) if e.id not in self.in_flight
        ]

    async def _due(self, entries: list[Entry]) -> list[Entry]:
        """Entries delivered before, minus those in flight here or not yet due for a retry."""
        entries = [e for e in entries if e.id not in self.in_flight]
        if not entries:
            return []
        due_at: list[Any] = await self.client.hmget(self._retry_key, [e.id for e in entries])
        now = time.time()
        return [e for e, at in zip(entries, due_at, strict=True) if at is None or float(at) <= now]

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

    async def keep_alive(self) -> None:
        """Reset the idle time of entries in flight here, so no other consumer reclaims them."""
        if self.in_flight:
            await self.client.xclaim(
                self.stream,
                self.group,
                self.consumer,
                min_idle_time=0,
                message_ids=list(self.in_flight),
                justid=True,
            )

    def retry_delay_s(self, attempts: int) -> float:
        """Delay before retry number `attempts` (1-based): doubling from claim_idle_ms."""
        return float(min(self.backoff_max_s, self.claim_idle_ms / 1000 * 2 ** max(0, attempts - 1)))

    def queue_ack(self, pipe: Pipeline, *entry_ids: str) -> None:
        """Queue the acknowledgement of processed entries (and their retry state) on a pipeline."""
        if not entry_ids:
            return
        pipe.xack(self.stream, self.group, *entry_ids)
        if self.delete_acked:
            pipe.xdel(self.stream, *entry_ids)
        pipe.hdel(self._attempts_key, *entry_ids)
        pipe.hdel(self._retry_key, *entry_ids)

    async def ack(self, *entry_ids: str) -> None:
        """Acknowledge processed entries and forget their retry state."""
        if not entry_ids:
            return
        async with self.client.pipeline(transaction=True) as pipe:
            self.queue_ack(pipe, *entry_ids)
            await pipe.execute()

    async def fail(
        self, entry: Entry, error: str, dead_letters: list[dict[str, str]] | None = None
    ) -> bool:
        """Record a failed attempt; after `max_attempts` dead-letter it. True if dead.

        `dead_letters` are the entries written to the dead-letter stream (default: the
        entry's own fields); see `dead_letter`.
        """
        attempts = int(await self.client.hincrby(self._attempts_key, entry.id, 1))
        if attempts < self.max_attempts:
            delay = self.retry_delay_s(attempts)
            await self.client.hset(self._retry_key, entry.id, str(time.time() + delay))
            log.warning(
                "%s entry %s failed (attempt %d of %d, retry in %.1fs): %s",
                self.stream, entry.id, attempts, self.max_attempts, delay, error,
            )  # fmt: skip
            return False
        await self.dead_letter(entry, error, dead_letters, attempts=attempts)
        return True

    async def dead_letter(
        self,
        entry: Entry,
        error: str,
        dead_letters: list[dict[str, str]] | None = None,
        *,
        attempts: int = 1,
    ) -> None:
        """Move an entry to the dead-letter stream now, with the error, and acknowledge it.

        Each dead letter gets `error`, `source_id`, `source_stream` and `attempts` beside
        its fields.
        """
        async with self.client.pipeline(transaction=True) as pipe:
            for fields in dead_letters if dead_letters is not None else [entry.fields]:
                dead = dict(fields)
                dead.update(
                    error=error[:ERROR_CHARS],
                    source_id=entry.id,
                    source_stream=self.stream,
                    attempts=str(attempts),
                )
                pipe.xadd(self.dead_letter_stream, dead)  # type: ignore[arg-type]
            self.queue_ack(pipe, entry.id)
            await pipe.execute()
        log.error(
            "%s entry %s dead-lettered to %s after %d attempt(s): %s",
            self.stream, entry.id, self.dead_letter_stream, attempts, error,
        )  # fmt: skip

    async def lag(self) -> tuple[int, int]:
        """(entries not yet delivered to the group, entries pending acknowledgement)."""
        info = await group_info(self.client, self.stream, self.group)
        if info is None:
            return 0, 0
        return int(info.get("lag") or 0), int(info.get("pending") or 0)


async def group_info(client: aredis.Redis, stream: str, group: str) -> dict[str, Any] | None:
    """XINFO GROUPS of `stream` for `group`, or None when the stream or group does not exist.

    Its `lag` (entries not yet delivered) is None when Redis cannot count it (entries were
    deleted mid-range).
    """
    try:
        groups = await client.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream (yet, or any more)
        return None
    for g in groups:
        if g["name"] == group:
            return dict(g)
    return None

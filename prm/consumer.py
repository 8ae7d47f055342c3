"""`liveloop.bus.StreamConsumer` with what the judging loop needs on top.

- Failed entries are retried with exponential backoff: the first retry comes when the entry
  is reclaimed (after `claim_idle_ms`), each later one waits twice as long, up to a cap. A
  reclaimed entry whose retry time has not come is left pending for a later reclaim.
- Dead letters go to a chosen stream (the judging loop sends failed turns to
  `liveloop:turns:dlq`, with the turn record itself), and malformed entries can be
  dead-lettered at once.
- Entries this process is still working on are not handed out again by a reclaim, here
  or (through `keep_alive`) by another consumer, however long a slow judge takes.
- Acknowledgements can be queued on a caller's pipeline, next to the output they confirm.
"""

from __future__ import annotations

import logging
import time

import redis.asyncio as aredis
from redis.asyncio.client import Pipeline

from liveloop.bus import Entry, StreamConsumer, stream_key

log = logging.getLogger(__name__)


class PrmConsumer(StreamConsumer):
    """At-least-once consumer with retry backoff and a configurable dead-letter stream."""

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
        super().__init__(
            client,
            stream,
            group,
            consumer,
            claim_idle_ms=claim_idle_ms,
            max_attempts=max_attempts,
            count=count,
        )
        self.dead_letter_stream = stream_key(dead_letter_stream or self.stream + ":dlq")
        self.backoff_max_s = backoff_max_s
        self.delete_acked = delete_acked
        self.in_flight: set[str] = set()
        self._retry_key = f"{self.stream}:retry:{group}"

    async def read(self, block_ms: int = 1000) -> list[Entry]:
        """Like StreamConsumer.read, minus entries in flight here or not yet due for retry."""
        entries = [e for e in await super().read(block_ms) if e.id not in self.in_flight]
        if not entries:
            return []
        due_at = await self.client.hmget(self._retry_key, [e.id for e in entries])  # type: ignore[misc]
        now = time.time()
        return [e for e, at in zip(entries, due_at, strict=True) if at is None or float(at) <= now]

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
        return min(self.backoff_max_s, self.claim_idle_ms / 1000 * 2 ** max(0, attempts - 1))

    def queue_ack(self, pipe: Pipeline, *entry_ids: str) -> None:
        """Queue the acknowledgement of processed entries on a pipeline."""
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
        entry's own fields); each gets `error`, `source_id`, `source_stream`, `attempts`.
        """
        attempts = int(await self.client.hincrby(self._attempts_key, entry.id, 1))  # type: ignore[misc]
        if attempts < self.max_attempts:
            delay = self.retry_delay_s(attempts)
            await self.client.hset(self._retry_key, entry.id, str(time.time() + delay))  # type: ignore[misc]
            log.warning(
                "entry %s failed (attempt %d, retry in %.1fs): %s", entry.id, attempts, delay, error
            )
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
        """Move an entry to the dead-letter stream now, with the error, and acknowledge it."""
        async with self.client.pipeline(transaction=True) as pipe:
            for fields in dead_letters if dead_letters is not None else [entry.fields]:
                dead = dict(fields)
                dead.update(
                    error=error[:2000],
                    source_id=entry.id,
                    source_stream=self.stream,
                    attempts=str(attempts),
                )
                pipe.xadd(self.dead_letter_stream, dead)  # type: ignore[arg-type]
            self.queue_ack(pipe, entry.id)
            await pipe.execute()
        log.error("entry %s dead-lettered after %d attempt(s): %s", entry.id, attempts, error)

"""Turn-record writing that can never slow down or fail a response.

The serving path only calls `TraceWriter.submit`, which appends to an in-memory queue and,
when asked, returns a future that resolves once the record is durable (in Redis, or fsynced
in the spool): the server waits on it, bounded, before a reply ends, so that a crash right
after a reply cannot lose its record. One background task drains the queue: while the spool is empty it XADDs each record to
`liveloop:turns` (exactly once per `TurnRecord.key`); when a write fails, that record and
every later one go to the fsynced spool instead, so order is kept, and the same task
probes Redis with backoff and replays the spool in order once Redis answers again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from pathlib import Path

import redis
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import ValidationError

from liveloop import bus
from liveloop.contracts import TurnRecord
from liveloop.server.traces.spool import Spool, SpooledLine, SpoolError

log = logging.getLogger(__name__)

Durable = asyncio.Future[bool]

WRITE_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5)
_REDIS_ERRORS = (redis.RedisError, OSError, asyncio.TimeoutError)


class _TraceMetrics:
    """The writer's Prometheus metrics, on the registry it was given."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.write_seconds = Histogram(
            "liveloop_trace_write_seconds",
            "Time to write one turn record to Redis (successful direct writes).",
            buckets=WRITE_BUCKETS,
            registry=registry,
        )
        self.backlog = Gauge(
            "liveloop_trace_spool_backlog",
            "Turn records in the on-disk spool waiting for Redis.",
            registry=registry,
        )
        self.records = Counter(
            "liveloop_trace_records",
            "Turn records by outcome: written to Redis, spooled to disk, replayed from the "
            "spool, quarantined (an unreadable spool line, e.g. a write torn by a crash, "
            "moved to <spool>.bad), or dropped (only when the disk fails).",
            ["outcome"],
            registry=registry,
        )
        self.torn = Counter(
            "liveloop_trace_spool_torn_tails",
            "Spool files found at start-up with a torn last line (a crash during a write).",
            registry=registry,
        )
        for outcome in ("written", "spooled", "replayed", "quarantined", "dropped"):
            self.records.labels(outcome)


class TraceWriter:
    """Writes TurnRecords to liveloop:turns without ever delaying or failing a response."""

    def __init__(
        self,
        redis_url: str,
        spool_dir: Path,
        registry: CollectorRegistry,
        *,
        probe_initial_s: float = 0.2,
        probe_max_s: float = 5.0,
        socket_timeout_s: float = 2.0,
        replay_batch: int = 256,
    ) -> None:
        self.redis_url = redis_url
        self.spool = Spool(Path(spool_dir))
        self.metrics = _TraceMetrics(registry)
        self.probe_initial_s = probe_initial_s
        self.probe_max_s = probe_max_s
        self.socket_timeout_s = socket_timeout_s
        self.replay_batch = replay_batch
        self._pending: collections.deque[tuple[TurnRecord, Durable | None]] = collections.deque()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._task: asyncio.Task[None] | None = None
        self._client: aredis.Redis | None = None
        self._stopping = False
        self._closed = False
        self._spool_lock = threading.Lock()
        self._probe_delay = probe_initial_s
        self._next_probe = 0.0

    @property
    def spool_backlog(self) -> int:
        """Records in the spool not yet replayed to Redis."""
        return self.spool.backlog

    @property
    def queued(self) -> int:
        """Records submitted and not yet written or spooled."""
        return len(self._pending)

    async def start(self) -> None:
        """Open the spool (adopting leftovers of earlier processes) and start the writer task."""
        await asyncio.to_thread(self.spool.open)
        self.metrics.torn.inc(self.spool.torn_tails)
        self._update_backlog()
        # retries are this class's business, not redis-py's
        self._client = bus.redis_client(
            self.redis_url, timeout_s=self.socket_timeout_s, retries=False
        )
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="trace-writer")
        if self._pending:
            self._wake.set()

    async def stop(self) -> None:
        """Flush the in-memory queue to Redis or the spool, then release everything."""
        self._stopping = True
        if self._task is not None:
            assert self._wake is not None
            self._wake.set()
            try:
                await self._task
            except Exception:
                log.exception("trace writer task failed")
            self._task = None
        with self._spool_lock:
            self._closed = True
            rest = list(self._pending)
            self._pending.clear()
        _settle(rest, await asyncio.to_thread(self._spool_now, [t for t, _ in rest]))
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        await asyncio.to_thread(self.spool.close)

    def submit(self, turn: TurnRecord, durable: bool = False) -> Durable | None:
        """Queue a record for writing; never blocks, never raises. Don't mutate it afterwards.

        With `durable` (from the event loop's thread, once started), returns a future that
        becomes True once the record is in Redis or fsynced in the spool (False if dropped).
        """
        waiter: Durable | None = None
        try:
            if durable and self._loop is not None and threading.get_ident() == self._loop_thread:
                waiter = self._loop.create_future()
            with self._spool_lock:
                closed = self._closed
                if not closed:
                    self._pending.append((turn, waiter))
            if closed:  # after stop(): the spool is closed, so append to a fresh one
                log.warning("trace writer stopped; spooling turn %s synchronously", turn.key)
                _settle([(turn, waiter)], self._spool_after_stop(turn))
                return waiter
            self._wakeup()
        except Exception:
            log.exception("could not queue turn record %s", getattr(turn, "key", "?"))
        return waiter

    def _wakeup(self) -> None:
        if self._wake is None or self._loop is None:
            return  # not started: start() picks the queue up
        if threading.get_ident() == self._loop_thread:
            self._wake.set()
        else:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _run(self) -> None:
        """The writer task: one step at a time until stopped; a failing step never ends it."""
        while True:
            try:
                if not await self._step():
                    return
            except Exception:
                log.exception("trace writer step failed; retrying in %.1fs", self._probe_delay)
                self._next_probe = time.monotonic() + self._probe_delay
                await asyncio.sleep(self._probe_delay)

    async def _step(self) -> bool:
        """Write or spool queued records, else replay the spool, else wait; False when done."""
        assert self._wake is not None
        batch = self._take(self.replay_batch)
        if batch:
            if self.spool.backlog:
                spooled = await asyncio.to_thread(self._spool_now, [t for t, _ in batch])
                _settle(batch, spooled)
            else:
                await self._write_direct(batch)
            return True
        if self._stopping:
            return False
        now = time.monotonic()
        if self.spool.backlog and now >= self._next_probe:
            await self._replay_some()
            return True
        self._wake.clear()
        if self._pending:
            return True
        timeout = max(0.0, self._next_probe - now) if self.spool.backlog else None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)
        return True

    def _take(self, limit: int) -> list[tuple[TurnRecord, Durable | None]]:
        batch: list[tuple[TurnRecord, Durable | None]] = []
        while self._pending and len(batch) < limit:
            batch.append(self._pending.popleft())
        return batch

    async def _publish(self, turn: TurnRecord) -> None:
        assert self._client is not None
        await bus.publish(
            self._client,
            bus.TURNS,
            turn,
            dedupe_key=turn.key,
            session_id=turn.session_id,
            turn_index=turn.turn_index,
            turn_type=turn.turn_type,
        )

    async def _write_direct(self, batch: list[tuple[TurnRecord, Durable | None]]) -> None:
        for i, (turn, waiter) in enumerate(batch):
            start = time.perf_counter()
            try:
                await self._publish(turn)
            except Exception as exc:  # whatever went wrong, the spool keeps the record
                log.warning("trace write failed (%r); spooling until Redis is back", exc)
                self._next_probe = time.monotonic() + self._probe_delay
                rest = batch[i:]
                _settle(rest, await asyncio.to_thread(self._spool_now, [t for t, _ in rest]))
                return
            self.metrics.write_seconds.observe(time.perf_counter() - start)
            self.metrics.records.labels("written").inc()
            _settle([(turn, waiter)], [True])

    def _spool_now(self, turns: list[TurnRecord]) -> list[bool]:
        """Append to the spool (worker thread); per record, whether it is durable now.

        On disk failure log loudly and count drops.
        """
        if not turns:
            return []
        lines, kept = [], []
        for turn in turns:
            try:
                lines.append(turn.model_dump_json())
                kept.append(True)
            except Exception:
                log.exception("DROPPED turn record %s: it cannot be serialised", turn.key)
                self.metrics.records.labels("dropped").inc()
                kept.append(False)
        try:
            self.spool.append(lines)
        except SpoolError as exc:
            log.critical("DROPPED %d turn records: %s", len(lines), exc)
            self.metrics.records.labels("dropped").inc(len(lines))
            return [False] * len(turns)
        self.metrics.records.labels("spooled").inc(len(lines))
        self._update_backlog()
        return kept

    def _spool_after_stop(self, turn: TurnRecord) -> list[bool]:
        spool = Spool(self.spool.directory, self.spool.name)
        try:
            spool.open(adopt=False)
            spool.append([turn.model_dump_json()])
            self.metrics.records.labels("spooled").inc()
            return [True]
        except (SpoolError, OSError) as exc:
            log.critical("DROPPED turn record %s: %s", turn.key, exc)
            self.metrics.records.labels("dropped").inc()
            return [False]
        finally:
            spool.close()

    async def _replay_some(self) -> None:
        """Replay one batch of the spool in order; on failure back off the next probe."""
        lines = await asyncio.to_thread(self.spool.read_batch, self.replay_batch)
        try:
            for line in lines:
                await self._replay_line(line)
                self.spool.advance(line)
        except _REDIS_ERRORS as exc:
            self._next_probe = time.monotonic() + self._probe_delay
            log.info("trace spool replay waits %.1fs: %s", self._probe_delay, exc)
            self._probe_delay = min(self._probe_delay * 2, self.probe_max_s)
            return
        finally:
            self._update_backlog()
        await asyncio.to_thread(self.spool.compact)
        self._probe_delay = self.probe_initial_s
        if not self.spool.backlog:
            log.info("trace spool fully replayed")

    async def _replay_line(self, line: SpooledLine) -> None:
        try:
            turn = TurnRecord.model_validate_json(line.text)
            await self._publish(turn)
        except _REDIS_ERRORS:
            raise
        except (ValidationError, ValueError, TypeError) as exc:  # a poison line: set it aside
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.critical(
                "unreadable spool line %s@%d (%d bytes) quarantined in %s: %s",
                line.path,
                line.start,
                len(line.raw),
                self.spool.quarantine_path,
                reason,
            )
            await asyncio.to_thread(self._quarantine, line, reason)
            return
        self.metrics.records.labels("replayed").inc()

    def _quarantine(self, line: SpooledLine, reason: str) -> None:
        try:
            self.spool.quarantine(line, reason)
        except OSError as exc:
            log.critical("DROPPED an unreadable spool line: cannot quarantine it: %s", exc)
            self.metrics.records.labels("dropped").inc()
            return
        self.metrics.records.labels("quarantined").inc()

    def _update_backlog(self) -> None:
        self.metrics.backlog.set(self.spool.backlog)


def _settle(items: list[tuple[TurnRecord, Durable | None]], durable: list[bool]) -> None:
    """Resolve the durability futures of written, spooled or dropped records."""
    for (_turn, waiter), ok in zip(items, durable, strict=True):
        if waiter is not None and not waiter.done():
            waiter.set_result(ok)

"""Stream retention: archive, then trim, the entries every reader of a stream is done with.

Without it the streams only grow (every turn is kept in Redis memory for ever). A pass goes
over every public stream and its dead-letter twin; an entry is trimmed only when

- every consumer group of its stream has it delivered and acknowledged (ids below each
  group's oldest pending entry and at most its last-delivered id), and each group that
  reads the stream (`keys.READERS`) exists: a stream whose reader has not started yet keeps
  everything, since a new group reads from the stream's start;
- it is older than the stream's window (`retention.windows`), measured on Redis' clock;
- it is not among the newest `retention.keep_newest` entries of the stream (what readers
  of the newest entries need: the gate's served probes, the weights followers).

Those entries are a prefix of the stream. They are written to the archive
(`liveloop.bus.archive`) and only then trimmed (XTRIM MINID), so a crash in between leaves
them both archived and in Redis: the next pass archives them again (readers of the archive
yield each id once) and trims them. The bound is computed again, atomically with the trim,
in one script that also checks this process still holds the retention lock (SET NX PX), so
two collectors never trim at once and a group created meanwhile is respected.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry, Counter

from liveloop.bus import keys
from liveloop.bus.archive import ArchiveWriter, next_id, parse_id, stream_dir_name
from liveloop.config.retention import RetentionSettings

log = logging.getLogger(__name__)

PAGE = 256  # entries per XRANGE while archiving

# KEYS: the stream, the lock. ARGV: lock token, 'bound' or 'trim', the cut (ms, seq), then
# the groups that must exist. Lowers the cut to what every group has delivered and
# acknowledged; 'trim' then trims below it. Returns {code, cut}: code -1 = lock not held,
# -2 = a reader's group is missing, -3 = no stream, else the number of entries trimmed.
_BOUND_AND_TRIM = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {-1, ''} end
if redis.call('EXISTS', KEYS[1]) == 0 then return {-3, ''} end
local cut_ms, cut_seq = tonumber(ARGV[3]), tonumber(ARGV[4])
local function lower(ms, seq)
  if ms < cut_ms or (ms == cut_ms and seq < cut_seq) then cut_ms, cut_seq = ms, seq end
end
local function split(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local seen = {}
for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local info = {}
  for i = 1, #group, 2 do info[group[i]] = group[i + 1] end
  seen[info['name']] = true
  local ms, seq = split(info['last-delivered-id'])
  lower(ms, seq + 1)
  local pending = redis.call('XPENDING', KEYS[1], info['name'])
  if pending[1] > 0 then lower(split(pending[2])) end
end
for i = 5, #ARGV do
  if not seen[ARGV[i]] then return {-2, ''} end
end
local cut = string.format('%.0f-%.0f', cut_ms, cut_seq)
if ARGV[2] == 'trim' then return {redis.call('XTRIM', KEYS[1], 'MINID', cut), cut} end
return {0, cut}
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RetentionMetrics:
    """Entries archived and trimmed, archive bytes written, per stream; passes by outcome."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.archived = Counter(
            "liveloop_retention_archived_entries",
            "Stream entries written to the archive before being trimmed.",
            ["stream"],
            registry=r,
        )
        self.trimmed = Counter(
            "liveloop_retention_trimmed_entries",
            "Stream entries trimmed from Redis by retention.",
            ["stream"],
            registry=r,
        )
        self.archive_bytes = Counter(
            "liveloop_retention_archive_bytes",
            "Bytes of archive files written (gzip).",
            ["stream"],
            registry=r,
        )
        self.passes = Counter(
            "liveloop_retention_passes",
            "Retention passes, by outcome (done; busy: another collector held the lock; failed).",
            ["outcome"],
            registry=r,
        )
        for outcome in ("done", "busy", "failed"):
            self.passes.labels(outcome)


@dataclass(frozen=True)
class RetainedStream:
    """One stream under retention: its key, the groups that must read it, its limits."""

    key: str
    readers: tuple[str, ...]
    window_s: float
    keep_newest: int

    @property
    def label(self) -> str:
        """The stream's name in metrics and in the archive (`turns`, `turns.dlq`)."""
        return stream_dir_name(self.key)


def retained_streams(settings: RetentionSettings) -> list[RetainedStream]:
    """Every public stream, then every dead-letter twin, with their settings."""
    out = [
        RetainedStream(
            keys.stream_key(name),
            keys.READERS[name],
            float(getattr(settings.windows, name)),
            int(getattr(settings.keep_newest, name)),
        )
        for name in keys.STREAMS
    ]
    out += [
        RetainedStream(
            keys.dlq_key(name), (), settings.windows.dead_letters, settings.keep_newest.dead_letters
        )
        for name in keys.DEAD_LETTERED
    ]
    return out


@dataclass
class StreamReport:
    """What one pass did to one stream (`skipped`: why nothing was trimmed, if so)."""

    stream: str
    archived: int = 0
    trimmed: int = 0
    bytes: int = 0
    files: int = 0
    skipped: str | None = None


class LockLost(Exception):
    """The retention lock expired or was taken by another process during a pass."""


class Retention:
    """Archives and trims the streams; `run()` every `interval_s`, or `run_once()`."""

    def __init__(
        self,
        client: aredis.Redis,
        settings: RetentionSettings,
        data_dir: Path,
        metrics: RetentionMetrics | None = None,
    ) -> None:
        self.client = client
        self.settings = settings
        self.archive_root = settings.archive_path(Path(data_dir))
        self.metrics = metrics or RetentionMetrics()
        self.streams = retained_streams(settings)
        self.token = uuid.uuid4().hex
        self._bound_and_trim = client.register_script(_BOUND_AND_TRIM)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    async def run(self) -> None:
        """A pass every `interval_s` until cancelled; a failed pass is logged, not fatal."""
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                await self.run_once()
            except LockLost as exc:
                self.metrics.passes.labels("busy").inc()
                log.warning("retention pass cut short: %s", exc)
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                self.metrics.passes.labels("failed").inc()
                log.warning(
                    "retention pass failed (%s); next in %.0fs", exc, self.settings.interval_s
                )
            except Exception:
                self.metrics.passes.labels("failed").inc()
                log.exception("retention pass failed")

    async def run_once(self) -> list[StreamReport] | None:
        """One pass over every stream; None when another process holds the lock."""
        if not await self._acquire():
            self.metrics.passes.labels("busy").inc()
            return None
        reports: list[StreamReport] = []
        try:
            for stream in self.streams:
                reports.append(await self.retain(stream))
        finally:
            await self._release(keys=[keys.RETENTION_LOCK], args=[self.token])
        self.metrics.passes.labels("done").inc()
        done = [r for r in reports if r.trimmed or r.archived]
        if done:
            log.info(
                "retention: %s",
                ", ".join(f"{r.stream} {r.archived} archived/{r.trimmed} trimmed" for r in done),
            )
        return reports

    async def retain(self, stream: RetainedStream) -> StreamReport:
        """Archive and trim what may go of one stream, a chunk at a time (the lock must be
        held; it is renewed before each chunk)."""
        report = StreamReport(stream.label)
        while True:
            if not await self._renew(keys=[keys.RETENTION_LOCK], args=[self.token, self._ttl_ms]):
                raise LockLost("retention lock lost during the pass")
            done = await self._chunk(stream, report)
            if done < self.settings.chunk_entries:
                return report

    async def _chunk(self, stream: RetainedStream, report: StreamReport) -> int:
        """Archive and trim up to `chunk_entries` entries; how many were trimmed."""
        room = min(
            self.settings.chunk_entries,
            int(await self.client.xlen(stream.key)) - stream.keep_newest,
        )
        if room <= 0:
            report.skipped = report.skipped or "no more entries than keep_newest"
            return 0
        code, cut = await self._script(stream, "bound", await self._age_cut(stream))
        if code < 0:
            report.skipped = _REASONS[code]
            return 0
        end = await self._archive(stream, cut, room, report)
        if end is None:
            report.skipped = report.skipped or "nothing old enough and acknowledged"
            return 0
        code, _ = await self._script(stream, "trim", end)
        if code == -1:
            raise LockLost("retention lock lost before a trim")
        trimmed = max(code, 0)
        report.trimmed += trimmed
        self.metrics.trimmed.labels(stream.label).inc(trimmed)
        return trimmed

    async def _age_cut(self, stream: RetainedStream) -> str:
        """Entries below this id are older than the stream's window."""
        now_ms = await self._now_ms()
        return f"{max(0, int(now_ms - stream.window_s * 1000))}-0"

    async def _script(self, stream: RetainedStream, mode: str, cut: str) -> tuple[int, str]:
        ms, seq = parse_id(cut)
        args: list[str | int] = [self.token, mode, ms, seq, *stream.readers]
        reply: Any = await self._bound_and_trim(keys=[stream.key, keys.RETENTION_LOCK], args=args)
        return int(reply[0]), str(reply[1])

    async def _archive(
        self, stream: RetainedStream, cut: str, room: int, report: StreamReport
    ) -> str | None:
        """Read the oldest entries below `cut` (at most `room`) and archive them (when the
        archive is on); the cut that covers exactly those, or None when there are none."""
        writer = ArchiveWriter(self.archive_root, stream.key) if self.settings.archive else None
        start, last = "-", None
        try:
            while room > 0:
                page: Any = await self.client.xrange(
                    stream.key, min=start, max="(" + cut, count=min(PAGE, room)
                )
                if not page:
                    break
                entries = [(str(i), dict(f)) for i, f in page]
                if writer is not None:
                    await asyncio.to_thread(writer.add, entries)
                last, room = entries[-1][0], room - len(entries)
                start = "(" + last
            if writer is not None:
                written = await asyncio.to_thread(writer.close)
                report.archived += written.entries
                report.bytes += written.bytes
                report.files += len(written.files)
                self.metrics.archived.labels(stream.label).inc(written.entries)
                self.metrics.archive_bytes.labels(stream.label).inc(written.bytes)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        return None if last is None else next_id(last)

    async def _acquire(self) -> bool:
        return bool(
            await self.client.set(keys.RETENTION_LOCK, self.token, nx=True, px=self._ttl_ms)
        )

    @property
    def _ttl_ms(self) -> int:
        return int(self.settings.lock_ttl_s * 1000)

    async def _now_ms(self) -> float:
        """Now on Redis' clock, which also stamped the entry ids."""
        seconds, micros = await self.client.time()
        return seconds * 1000 + micros / 1000


_REASONS = {-1: "lock not held", -2: "a reading group does not exist yet", -3: "no stream"}


def start_retention(
    client: aredis.Redis,
    settings: RetentionSettings,
    data_dir: Path,
    registry: CollectorRegistry | None = None,
) -> asyncio.Task[None] | None:
    """Run retention in the background of the calling loop (None when it is disabled);
    cancel the task to stop it (a pass cut short only leaves entries to archive again)."""
    if not settings.enabled:
        return None
    retention = Retention(client, settings, data_dir, RetentionMetrics(registry))
    log.info(
        "retention on: a pass every %.0fs, archive %s",
        settings.interval_s,
        retention.archive_root if settings.archive else "off",
    )
    return asyncio.create_task(retention.run(), name="retention")

"""The on-disk spool: where turn records wait while Redis cannot take them.

Records are JSON lines appended to a file that this process holds an exclusive `flock`
on; an append counts only once it is fsynced. Files left by earlier processes (found
unlocked at `open()`) are replayed before this process's own file, oldest first. A replay
reads complete lines from a cursor; when the cursor reaches the end of a file, a leftover
file is deleted and the own file is truncated. A crash anywhere in between only means
some records are sent again, which the stream's dedupe key turns into a no-op.

A crash during an append can leave a torn last line (no newline) or garbage (zero-filled
blocks) at the end of a file. `open()` ends a torn tail with a newline instead of cutting
it, so every byte is read back as a line: a line that parses is replayed (a record whose
newline alone was lost is not lost), one that does not is moved by the reader to the
quarantine file `<name>.bad` with `quarantine()` and counted. Nothing in a file can make
reading it raise.

The class is synchronous (plain file I/O and fsync) and meant to be driven from one task
at a time, through `asyncio.to_thread`, so that disk latency never reaches the event loop.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

SUFFIX = ".spool"


@dataclass
class _SpoolFile:
    path: Path
    handle: IO[bytes]
    own: bool
    cursor: int = 0  # byte offset of the first line not yet replayed


@dataclass(frozen=True)
class SpooledLine:
    """One spooled record, the file holding it and its byte range there (for `advance`)."""

    text: str
    path: Path
    start: int
    end: int
    raw: bytes = b""  # the line's bytes without the newline (what `quarantine` keeps)


class SpoolError(OSError):
    """The spool cannot be written (disk full, permissions); the message names the file."""


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _try_lock(path: Path, create: bool) -> IO[bytes] | None:
    """Open `path` for appending and take an exclusive non-blocking lock, or None."""
    if not create and not path.exists():
        return None
    handle = open(path, "a+b")  # noqa: SIM115 - kept open for the spool's lifetime
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def _repair_tail(spool: _SpoolFile) -> bool:
    """End a torn last line (a crash mid-append) with a newline; True if there was one.

    The line is then read like any other: replayed if it parses, quarantined if not.
    """
    size = os.fstat(spool.handle.fileno()).st_size
    if size == 0:
        return False
    spool.handle.seek(max(0, size - 1))
    if spool.handle.read(1) == b"\n":
        return False
    log.warning("spool %s: its last line is torn (a crash during a write)", spool.path)
    os.write(spool.handle.fileno(), b"\n")  # O_APPEND
    os.fsync(spool.handle.fileno())
    return True


def _count_lines(spool: _SpoolFile) -> int:
    spool.handle.seek(spool.cursor)
    return sum(chunk.count(b"\n") for chunk in iter(lambda: spool.handle.read(1 << 20), b""))


class Spool:
    """Append-only, fsynced JSON-lines files of records not yet written to Redis."""

    def __init__(self, directory: Path, name: str = "turns") -> None:
        self.directory = Path(directory)
        self.name = name
        self._files: list[_SpoolFile] = []
        self._backlog = 0
        self.torn_tails = 0  # torn last lines found by `open()`
        self.quarantined = 0  # lines moved to the quarantine file by this process

    @property
    def backlog(self) -> int:
        """Records spooled and not yet replayed (leftovers of earlier processes included)."""
        return self._backlog

    @property
    def own_path(self) -> Path | None:
        """The file this process appends to."""
        return self._files[-1].path if self._files else None

    def open(self, adopt: bool = True) -> None:
        """Lock an own file, adopt unlocked leftovers, repair torn tails, count the backlog."""
        self.directory.mkdir(parents=True, exist_ok=True)
        own_path = self.directory / f"{self.name}{SUFFIX}"
        handle = _try_lock(own_path, create=True)
        if handle is None:  # another live process spools into the default file
            own_path = self.directory / f"{self.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{SUFFIX}"
            handle = _try_lock(own_path, create=True)
            if handle is None:
                raise SpoolError(f"cannot lock spool file {own_path}")
        _fsync_dir(self.directory)
        own = _SpoolFile(own_path, handle, own=True)
        leftovers: list[_SpoolFile] = []
        candidates = sorted(self.directory.glob(f"{self.name}*{SUFFIX}"), key=_mtime)
        for path in candidates if adopt else []:
            if path == own_path:
                continue
            other = _try_lock(path, create=False)
            if other is not None:
                leftovers.append(_SpoolFile(path, other, own=False))
        self._files = [*leftovers, own]
        for spool in self._files:
            self.torn_tails += _repair_tail(spool)
            self._backlog += _count_lines(spool)
        if self._backlog:
            log.warning(
                "trace spool: %d records left by an earlier process in %s will be replayed",
                self._backlog,
                self.directory,
            )

    def append(self, lines: list[str]) -> None:
        """Append records (one JSON document each, no newlines) and fsync; raises SpoolError."""
        if not lines:
            return
        if not self._files:
            raise SpoolError("spool is not open")
        own = self._files[-1]
        data = "".join(line + "\n" for line in lines).encode()
        try:
            os.write(own.handle.fileno(), data)  # O_APPEND: lands at the end
            os.fsync(own.handle.fileno())
        except OSError as exc:
            raise SpoolError(f"cannot append to spool file {own.path}: {exc}") from exc
        self._backlog += len(lines)

    def read_batch(self, max_lines: int) -> list[SpooledLine]:
        """Up to `max_lines` complete lines from the replay cursor, in order."""
        for spool in self._files:
            spool.handle.seek(spool.cursor)
            lines: list[SpooledLine] = []
            offset = spool.cursor
            for raw in spool.handle:
                if not raw.endswith(b"\n"):
                    break  # not possible for fsynced appends; leave it for later
                body = raw[:-1]
                text = body.decode(errors="replace")
                lines.append(SpooledLine(text, spool.path, offset, offset + len(raw), body))
                offset += len(raw)
                if len(lines) >= max_lines:
                    break
            if lines:
                return lines
        return []

    def advance(self, line: SpooledLine) -> None:
        """Mark `line` (the next one in replay order) as replayed; no disk I/O."""
        spool = next((f for f in self._files if f.path == line.path), None)
        if spool is None or spool.cursor != line.start:
            raise ValueError(f"spool lines must be advanced in order ({line.path}@{line.start})")
        spool.cursor = line.end
        self._backlog -= 1

    @property
    def quarantine_path(self) -> Path:
        """Where unreadable lines are kept for inspection (never replayed)."""
        return self.directory / f"{self.name}.bad"

    def quarantine(self, line: SpooledLine, reason: str) -> None:
        """Append an unreadable line to the quarantine file (fsynced); raises OSError."""
        header = f"# {line.path.name}@{line.start}: {reason}".replace("\n", " ")[:500]
        with open(self.quarantine_path, "ab") as fh:
            fh.write(header.encode() + b"\n" + (line.raw or line.text.encode()) + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.quarantined += 1

    def compact(self) -> None:
        """Delete fully replayed leftovers and truncate the own file once fully replayed."""
        while self._files:
            spool = self._files[0]
            size = os.fstat(spool.handle.fileno()).st_size
            if spool.cursor < size:
                return
            if not spool.own:
                spool.path.unlink(missing_ok=True)
                _fsync_dir(self.directory)
                spool.handle.close()
                self._files.pop(0)
                continue
            spool.handle.truncate(0)
            os.fsync(spool.handle.fileno())
            spool.cursor = 0
            return

    def close(self) -> None:
        """Release the locks; unreplayed records stay on disk for the next process."""
        for spool in self._files:
            with contextlib.suppress(OSError):
                spool.handle.close()
        own = self._files[-1] if self._files else None
        if own is not None and own.path.name != f"{self.name}{SUFFIX}":
            with contextlib.suppress(OSError):
                if own.path.stat().st_size == 0:
                    own.path.unlink()
        self._files = []
        self._backlog = 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0

"""The stream archive: entries trimmed from Redis, kept on disk as gzip JSON lines.

Retention (`liveloop.bus.retention`) writes each range of entries it is about to trim here
first, so a trimmed turn can still be replayed (`liveloop judge --replay --archive`). The
layout is one directory per stream (`turns`, `scored`, `turns.dlq`, ...), one per UTC day of
the entries, and one file per archived range:

    <archive>/<stream>/<YYYY-MM-DD>/<first-id>_<last-id>.jsonl.gz

Each line is `{"id": "<entry id>", "fields": {...}}`, the entry's fields exactly as Redis
held them (the `data` field is the JSON contract). A file is written under a temporary name
and renamed when complete, so a reader never sees half a file; a crash between archiving and
trimming leaves entries both here and in Redis, and archiving them again later writes a
file that overlaps. Readers therefore merge overlapping files and yield each id once.
"""

from __future__ import annotations

import gzip
import heapq
import json
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from liveloop.bus.keys import PREFIX

EntryId = tuple[int, int]
Fields = dict[str, str]
RawEntry = tuple[str, Fields]
SUFFIX = ".jsonl.gz"
MAX_SEQ = 2**64 - 1


def parse_id(entry_id: str, *, low: bool = True) -> EntryId:
    """A stream id as a comparable pair; `ms` alone is the lowest (or highest) id of that ms."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq) if seq else (0 if low else MAX_SEQ)


def format_id(entry_id: EntryId) -> str:
    """The Redis spelling of an id pair."""
    return f"{entry_id[0]}-{entry_id[1]}"


def next_id(entry_id: str) -> str:
    """The smallest id after `entry_id`."""
    ms, seq = parse_id(entry_id)
    return format_id((ms, seq + 1))


def stream_dir_name(stream: str) -> str:
    """The archive directory of a stream: its short name, `:` as `.` (`turns.dlq`)."""
    short = stream[len(PREFIX) :] if stream.startswith(PREFIX) else stream
    return short.replace(":", ".")


@dataclass(frozen=True)
class ArchiveFile:
    """One archived range of one stream."""

    path: Path
    first: EntryId
    last: EntryId

    @classmethod
    def parse(cls, path: Path) -> ArchiveFile | None:
        """The range in a file's name, or None for a name that is not an archive file."""
        stem = path.name[: -len(SUFFIX)]
        first, sep, last = stem.partition("_")
        try:
            return cls(path, parse_id(first), parse_id(last)) if sep else None
        except ValueError:
            return None

    def lines(self) -> Iterator[tuple[EntryId, RawEntry]]:
        """The file's entries, in order."""
        with gzip.open(self.path, "rt", encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    record = json.loads(line)
                    entry_id = str(record["id"])
                    yield parse_id(entry_id), (entry_id, dict(record["fields"]))


@dataclass
class WriteReport:
    """What one archive write produced."""

    files: list[Path] = field(default_factory=list)
    entries: int = 0
    bytes: int = 0
    first_id: str | None = None
    last_id: str | None = None


def write_atomically(path: Path, entries: Iterable[RawEntry]) -> int:
    """Write entries as a gzip JSON-lines file, complete or not at all; returns its bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as raw:
            with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
                for entry_id, fields in entries:
                    gz.write(_line(entry_id, fields))
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _sync_dir(path.parent)
    return path.stat().st_size


def _line(entry_id: str, fields: Fields) -> bytes:
    record = {"id": entry_id, "fields": fields}
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ArchiveWriter:
    """Archives one ascending run of a stream's entries: one file per UTC day, streamed to a
    temporary file and renamed into place when its day ends or at `close()`."""

    def __init__(self, root: Path, stream: str) -> None:
        self.directory = Path(root) / stream_dir_name(stream)
        self.report = WriteReport()
        self._day: str | None = None
        self._tmp: Path | None = None
        self._raw: IO[bytes] | None = None
        self._gz: gzip.GzipFile | None = None
        self._first: str | None = None
        self._last: str | None = None
        self._count = 0

    def add(self, entries: Iterable[RawEntry]) -> None:
        """Append entries (ascending ids, after those added before)."""
        for entry_id, fields in entries:
            day = _utc_day(entry_id)
            if day != self._day:
                self._finish()
                self._open(day, entry_id)
            assert self._gz is not None
            self._gz.write(_line(entry_id, fields))
            self._last = entry_id
            self._count += 1

    def close(self) -> WriteReport:
        """Complete the last file; the report of every file written."""
        self._finish()
        return self.report

    def abort(self) -> None:
        """Drop the file being written (the files completed before stay)."""
        if self._raw is not None:
            self._raw.close()
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
        self._tmp = self._raw = self._gz = None
        self._day = None

    def _open(self, day: str, first: str) -> None:
        folder = self.directory / day
        folder.mkdir(parents=True, exist_ok=True)
        self._tmp = folder / f".{first}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._raw = open(self._tmp, "wb")  # noqa: SIM115 - closed in _finish or abort
        self._gz = gzip.GzipFile(fileobj=self._raw, mode="wb", mtime=0)
        self._day, self._first, self._count = day, first, 0

    def _finish(self) -> None:
        if self._gz is None or self._raw is None or self._tmp is None or self._day is None:
            return
        self._gz.close()
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self._raw.close()
        path = self.directory / self._day / f"{self._first}_{self._last}{SUFFIX}"
        os.replace(self._tmp, path)
        _sync_dir(path.parent)
        self.report.files.append(path)
        self.report.bytes += path.stat().st_size
        self.report.entries += self._count
        self.report.first_id = self.report.first_id or self._first
        self.report.last_id = self._last
        self._tmp = self._raw = self._gz = None
        self._day = None


def _utc_day(entry_id: str) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(parse_id(entry_id)[0] / 1000))


class Archive:
    """Reads the archive: the files of a stream, and its entries in id order, each once."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def streams(self) -> list[str]:
        """Directory names of the archived streams."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())

    def files(self, stream: str) -> list[ArchiveFile]:
        """The archive files of a stream, by first id."""
        directory = self.root / stream_dir_name(stream)
        found = (ArchiveFile.parse(p) for p in directory.glob(f"*/*{SUFFIX}"))
        return sorted((f for f in found if f is not None), key=lambda f: (f.first, f.last))

    def entries(self, stream: str, min_id: str = "-", max_id: str = "+") -> Iterator[RawEntry]:
        """Archived entries of a stream with min_id <= id <= max_id, ascending, each id once
        (files that overlap, from a range archived twice, are merged)."""
        low = (0, 0) if min_id == "-" else parse_id(min_id, low=True)
        high = (MAX_SEQ, MAX_SEQ) if max_id == "+" else parse_id(max_id, low=False)
        files = [f for f in self.files(stream) if f.last >= low and f.first <= high]
        last: EntryId | None = None
        for cluster in _overlapping(files):
            merged = heapq.merge(*(f.lines() for f in cluster), key=lambda line: line[0])
            for entry_id, entry in merged:
                if entry_id < low or entry_id > high or (last is not None and entry_id <= last):
                    continue
                last = entry_id
                yield entry

    def pages(
        self, stream: str, min_id: str = "-", size: int = 512
    ) -> Iterator[list[tuple[str, Fields]]]:
        """`entries` in lists of up to `size`, like XRANGE pages."""
        page: list[RawEntry] = []
        for entry in self.entries(stream, min_id):
            page.append(entry)
            if len(page) >= size:
                yield page
                page = []
        if page:
            yield page


def _overlapping(files: list[ArchiveFile]) -> Iterator[list[ArchiveFile]]:
    """Files (sorted by first id) in runs whose ranges overlap."""
    cluster: list[ArchiveFile] = []
    end: EntryId | None = None
    for f in files:
        if cluster and end is not None and f.first > end:
            yield cluster
            cluster = []
        end = f.last if not cluster or end is None else max(end, f.last)
        cluster.append(f)
    if cluster:
        yield cluster


def read_data(fields: Fields) -> dict[str, Any] | None:
    """The `data` field as a JSON object, or None when it is missing or not one."""
    try:
        data = json.loads(fields.get("data", ""))
    except ValueError:
        return None
    return data if isinstance(data, dict) else None

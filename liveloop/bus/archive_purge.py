"""Deleting one tenant's entries from the stream archive (a tenant's right to be forgotten).

Turn records, judged turns, feedback and their dead letters carry `tenant`: those entries go,
and their session ids are noted. Training batches carry no tenant, only turn keys
(`session:turn:sample`): a batch loses the samples of the tenant's sessions (its token count
follows), and goes when none is left. A batch written by reference (`path`, a file under the
data dir) is not in the archive: its file is reported for the caller to delete. Each
changed file is rewritten atomically; a file left empty is removed.

Entries still in Redis are not touched here: delete those from the streams first, so a
retention pass running meanwhile cannot archive them again.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from liveloop.bus.archive import Archive, ArchiveFile, Fields, RawEntry, read_data
from liveloop.bus.archive import write_atomically as _write

BATCH_DIRS = frozenset({"batches", "batches.dlq"})


@dataclass
class PurgeReport:
    """What a purge removed from the archive."""

    entries_removed: int = 0
    samples_removed: int = 0
    files_rewritten: int = 0
    files_removed: int = 0
    sessions: list[str] = field(default_factory=list)
    referenced_batch_files: list[str] = field(default_factory=list)


def purge_tenant(root: Path, tenant: str, session_ids: Iterable[str] = ()) -> PurgeReport:
    """Remove every archived entry of `tenant` (and of `session_ids`, sessions the caller
    knows are the tenant's) from the archive under `root`."""
    archive = Archive(root)
    sessions = set(session_ids) | tenant_sessions(archive, tenant)
    report = PurgeReport(sessions=sorted(sessions))
    for stream in archive.streams():
        for archived in archive.files(stream):
            _purge_file(archived, stream in BATCH_DIRS, tenant, sessions, report)
    return report


def tenant_sessions(archive: Archive, tenant: str) -> set[str]:
    """Session ids of the tenant's archived records (every stream but the batches)."""
    found: set[str] = set()
    for stream in archive.streams():
        if stream in BATCH_DIRS:
            continue
        for archived in archive.files(stream):
            for _id, (_entry_id, fields) in archived.lines():
                data = read_data(fields)
                if data is not None and data.get("tenant") == tenant and data.get("session_id"):
                    found.add(str(data["session_id"]))
    return found


def session_of_key(turn_key: str) -> str:
    """The session id of a turn key `session:turn:sample` (a session id may hold `:`)."""
    return turn_key.rsplit(":", 2)[0]


def _purge_file(
    archived: ArchiveFile, batches: bool, tenant: str, sessions: set[str], report: PurgeReport
) -> None:
    kept: list[RawEntry] = []
    changed = False
    for _id, (entry_id, fields) in archived.lines():
        if batches:
            new_fields = _purge_batch(fields, sessions, report)
        else:
            new_fields = None if _belongs(fields, tenant, sessions) else fields
        if new_fields is None:
            report.entries_removed += 1
            changed = True
            continue
        changed = changed or new_fields is not fields
        kept.append((entry_id, new_fields))
    if not changed:
        return
    if kept:
        _write(archived.path, kept)
        report.files_rewritten += 1
    else:
        archived.path.unlink(missing_ok=True)
        report.files_removed += 1


def _belongs(fields: Fields, tenant: str, sessions: set[str]) -> bool:
    """Whether a (non-batch) entry is the tenant's: its record's tenant, or its session."""
    data = read_data(fields)
    if data is not None:
        if data.get("tenant") == tenant:
            return True
        if data.get("tenant") is None and str(data.get("session_id")) in sessions:
            return True
    turn_key = fields.get("turn_key")
    return fields.get("session_id") in sessions or (
        turn_key is not None and session_of_key(turn_key) in sessions
    )


def _purge_batch(fields: Fields, sessions: set[str], report: PurgeReport) -> Fields | None:
    """The batch entry without the sessions' samples (the same object when it has none of
    them; None when nothing is left)."""
    data = read_data(fields)
    if data is None:
        return fields
    samples: list[dict[str, Any]] | None = data.get("samples")
    if samples is None:
        if data.get("path"):
            report.referenced_batch_files.append(str(data["path"]))
        return fields
    kept = [s for s in samples if session_of_key(str(s.get("key", ""))) not in sessions]
    if len(kept) == len(samples):
        return fields
    report.samples_removed += len(samples) - len(kept)
    if not kept:
        return None
    tokens = sum(len(s["prompt_token_ids"]) + len(s["completion_token_ids"]) for s in kept)
    data.update(samples=kept, num_tokens=tokens)
    out = dict(fields, data=json.dumps(data, ensure_ascii=False, separators=(",", ":")))
    if "num_tokens" in out:
        out["num_tokens"] = str(tokens)
    return out

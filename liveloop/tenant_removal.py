"""Forgetting a tenant: everything `DELETE /admin/tenants/{key_id}` removes, in one place.

A tenant (an API key id) leaves nothing behind: its turns, judged turns, feedback and
dead letters and its adapters' weight announcements in the streams (`XDEL`), its batches (a batch of shared scope that also
holds other tenants' turns is written again without the tenant's), the judging loop's
waiting records of its sessions, its sessions (Redis and registry), its checkpoints (its
adapter versions under `<checkpoints>/tenants/<tenant>`), its versions and their quality
(registry, Redis counters), the base model's counters on its turns, and its records in the stream archive. Serving its adapters
is the server's to stop (the route does, after this). Every step is idempotent: a
removal repeated finds nothing and removes nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aredis

from liveloop.bus import keys
from liveloop.bus.archive_purge import purge_tenant, session_of_key
from liveloop.contracts import TrainingBatch, turn_key
from liveloop.registry import Registry
from liveloop.tenants import tenant_baseline_name, tenant_checkpoints, valid_tenant

log = logging.getLogger(__name__)

RECORD_STREAMS = (keys.TURNS, keys.SCORED, keys.FEEDBACK, keys.WEIGHTS)
SCAN_COUNT = 1000


@dataclass
class RemovalReport:
    """What went, by kind (the route's answer)."""

    tenant: str
    stream_entries: dict[str, int] = field(default_factory=dict)
    batches_rewritten: int = 0
    sessions: int = 0
    checkpoints: int = 0
    registry: dict[str, int] = field(default_factory=dict)
    archive_entries: int = 0

    @property
    def found(self) -> bool:
        """Whether anything of the tenant was there."""
        counted = [*self.stream_entries.values(), *self.registry.values()]
        return any(counted) or bool(self.sessions or self.checkpoints or self.archive_entries)


def _data(fields: dict[Any, Any]) -> dict[str, Any] | None:
    raw = fields.get("data", fields.get(b"data"))
    try:
        data = json.loads(raw) if raw is not None else None
    except (TypeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


async def _entries(client: aredis.Redis, stream: str) -> list[tuple[str, dict[Any, Any]]]:
    """Every entry of a stream, read in chunks."""
    found: list[tuple[str, dict[Any, Any]]] = []
    low = "-"
    while True:
        chunk = await client.xrange(stream, min=low, count=SCAN_COUNT)
        if not chunk:
            return found
        found += [(i.decode() if isinstance(i, bytes) else str(i), f or {}) for i, f in chunk]
        low = "(" + found[-1][0]


class TenantRemoval:
    """Removes one tenant's data from the bus, the disk and the registry."""

    def __init__(
        self,
        client: aredis.Redis,
        *,
        checkpoints_dir: Path,
        data_dir: Path,
        archive_dir: Path | None,
        db_url: str,
    ) -> None:
        self.client = client
        self.checkpoints_dir = Path(checkpoints_dir)
        self.data_dir = Path(data_dir)
        self.archive_dir = archive_dir
        self.db_url = db_url

    async def remove(self, tenant: str) -> RemovalReport:
        """Remove everything of `tenant`; returns what went."""
        if not valid_tenant(tenant):
            raise ValueError(f"not a tenant id: {tenant!r}")
        report = RemovalReport(tenant)
        sessions, turn_keys = await self._records(tenant, report)
        sessions |= await self._sessions(tenant, report)
        await self._batches(tenant, turn_keys, sessions, report)
        await self._waiting(sessions, turn_keys)
        await self._baselines(tenant)
        versions = await asyncio.to_thread(self._disk_and_registry, tenant, report)
        await self._quality(tenant, versions)
        if self.archive_dir is not None and self.archive_dir.is_dir():
            purged = await asyncio.to_thread(purge_tenant, self.archive_dir, tenant, sessions)
            report.archive_entries = purged.entries_removed + purged.samples_removed
            for path in purged.referenced_batch_files:
                (self.data_dir / path).unlink(missing_ok=True)
        log.info("tenant %s removed: %s", tenant, report)
        return report

    async def _records(self, tenant: str, report: RemovalReport) -> tuple[set[str], set[str]]:
        """XDEL the tenant's turns, judged turns and feedback (and their dead letters)."""
        sessions: set[str] = set()
        turn_keys: set[str] = set()
        for name in RECORD_STREAMS:
            for stream in (keys.stream_key(name), keys.dlq_key(name), keys.PRM_READY):
                doomed = []
                for entry_id, fields in await _entries(self.client, stream):
                    data = _data(fields)
                    if data is None or data.get("tenant") != tenant:
                        continue
                    doomed.append(entry_id)
                    if data.get("session_id"):
                        sessions.add(str(data["session_id"]))
                        index, sample = data.get("turn_index", 0), data.get("sample_index", 0)
                        turn_keys.add(turn_key(str(data["session_id"]), index, sample))
                if doomed:
                    await self.client.xdel(stream, *doomed)
                    report.stream_entries[stream] = report.stream_entries.get(stream, 0) + len(
                        doomed
                    )
        return sessions, turn_keys

    async def _sessions(self, tenant: str, report: RemovalReport) -> set[str]:
        """The tenant's session hashes and prefix-index entries."""
        sessions: set[str] = set()
        async for key in self.client.scan_iter(match=keys.SESSION_PREFIX + "*", count=500):
            name = key.decode() if isinstance(key, bytes) else str(key)
            owner = await self.client.hget(name, "tenant")
            owner = owner.decode() if isinstance(owner, bytes) else owner
            if owner == tenant:
                sessions.add(name.removeprefix(keys.SESSION_PREFIX))
                await self.client.delete(name)
        pattern = keys.prefix_index_key(tenant, "*")
        async for key in self.client.scan_iter(match=pattern, count=500):
            await self.client.delete(key)
        report.sessions = len(sessions)
        return sessions

    async def _batches(
        self, tenant: str, turn_keys: set[str], sessions: set[str], report: RemovalReport
    ) -> None:
        """Delete the tenant's batches; rewrite mixed ones without its samples."""
        stream = keys.stream_key(keys.BATCHES)
        for entry_id, fields in await _entries(self.client, stream):
            data = _data(fields)
            if data is None:
                continue
            try:
                batch = TrainingBatch.model_validate(data)
                samples = batch.samples
                if samples is None and batch.path is not None:
                    stored = (self.data_dir / batch.path).read_bytes()
                    samples = TrainingBatch.model_validate_json(stored).samples
            except (ValueError, OSError):
                continue
            theirs = [s for s in samples or [] if session_of_key(s.key) in sessions]
            if batch.tenant != tenant and not theirs:
                continue
            await self.client.xdel(stream, entry_id)
            report.stream_entries[stream] = report.stream_entries.get(stream, 0) + 1
            if batch.path is not None:
                (self.data_dir / batch.path).unlink(missing_ok=True)
            kept = [s for s in samples or [] if s not in theirs]
            if batch.tenant != tenant and kept:  # other tenants' turns stay trainable
                again = batch.model_copy(
                    update={"samples": kept, "path": None,
                            "num_tokens": sum(s.num_tokens for s in kept)}
                )  # fmt: skip
                await self.client.xadd(
                    stream, {"data": again.model_dump_json(), "batch_id": again.batch_id,
                             "num_tokens": str(again.num_tokens)},
                )  # fmt: skip
                report.batches_rewritten += 1
            turn_keys.update(s.key for s in theirs)
        if turn_keys:
            await self.client.zrem(keys.batch_members(), *turn_keys)

    async def _waiting(self, sessions: set[str], turn_keys: set[str]) -> None:
        """The judging loop's records of the tenant's turns waiting for their next state."""
        if turn_keys:
            await self.client.zrem(keys.PRM_DEADLINES, *turn_keys)
            await self.client.delete(*[keys.waiting_key(k) for k in turn_keys])
        groups = {k.rsplit(":", 1)[0] for k in turn_keys}
        for group in groups:
            await self.client.delete(
                keys.waiting_group(group), keys.early_feedback_key(group),
                keys.arrival_key(group), keys.side_marker(group),
            )  # fmt: skip

    async def _baselines(self, tenant: str) -> None:
        """The collector's reward baselines of the tenant (tenant scope)."""
        names: Any = await self.client.hkeys(keys.COLLECTOR_BASELINES)
        mark = tenant_baseline_name(tenant, "")
        doomed = [n for n in (str(x.decode() if isinstance(x, bytes) else x) for x in names)
                  if n.startswith(mark)]  # fmt: skip
        if doomed:
            await self.client.hdel(keys.COLLECTOR_BASELINES, *doomed)

    def _disk_and_registry(self, tenant: str, report: RemovalReport) -> list[int]:
        """The tenant's checkpoints and registry rows; returns its versions."""
        directory = tenant_checkpoints(self.checkpoints_dir, tenant)
        versions = set()
        if directory.is_dir():
            versions = {int(d.name[1:]) for d in directory.glob("v*") if d.name[1:].isdigit()}
            report.checkpoints = len(versions)
            shutil.rmtree(directory, ignore_errors=True)
        with Registry.open(self.db_url) as registry:
            rows = registry.list_model_versions(limit=1_000_000, tenant=tenant)
            versions |= {row.version for row in rows}
            report.registry = registry.delete_tenant(tenant)
        return sorted(versions)

    async def _quality(self, tenant: str, versions: list[int]) -> None:
        """The served-quality counters of the tenant's versions, and of the base on its turns."""
        doomed = [k for v in versions for k in (keys.quality_counters(v), keys.quality_bigrams(v))]
        await self.client.delete(
            *doomed, keys.tenant_base_quality(tenant), keys.tenant_base_bigrams(tenant)
        )
        if versions:
            await self.client.zrem(keys.QUALITY_VERSIONS, *[str(v) for v in versions])

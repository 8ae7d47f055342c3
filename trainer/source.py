"""Where batches come from and where new versions go: `liveloop:batches` in, announcements out.

`BatchSource` reads one batch at a time in consumer group `trainer` (inline samples, or the
file a large batch refers to), and acknowledges it only after the update it fed has been
checkpointed and announced. `Publisher` records versions in the registry and announces
them through the weight transport (`liveloop.weights`), exactly once per (version, path).
`trainable_samples` applies the collector's checks to a batch again when it is trained.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aredis
from pydantic import ValidationError

from liveloop import bus
from liveloop.bus.codec import Entry
from liveloop.config.consumer import ConsumerSettings
from liveloop.contracts import BatchSample, TrainingBatch, VersionStatus, WeightsAnnouncement
from liveloop.registry import Registry
from liveloop.samples import staleness, untrainable
from liveloop.trainer.checkpoints import TrainerState
from liveloop.trainer.metrics import TrainerMetrics
from liveloop.trainer.objectives import Objective
from liveloop.weights import WeightTransport, adapter_meta

log = logging.getLogger(__name__)


@dataclass
class ReceivedBatch:
    """A batch read from the stream, with its samples loaded."""

    entry_id: str
    batch: TrainingBatch
    samples: list[BatchSample]
    file: Path | None


def load_batch_file(data_dir: Path, path: str) -> list[BatchSample]:
    """Samples of a batch stored by reference (path relative to the data dir, or absolute)."""
    full = Path(data_dir) / path
    stored = TrainingBatch.model_validate_json(full.read_bytes())
    return stored.samples or []


def trainable_samples(
    samples: list[BatchSample],
    version: int,
    objective: Objective,
    max_staleness: int,
    metrics: TrainerMetrics,
    lag: Callable[[BatchSample], int] | None = None,
) -> list[BatchSample]:
    """Valid samples within the staleness bound of `version` (the collector's checks,
    applied again: the trainer may have moved on since the batch was packed).

    A sample the objective cannot learn from (the 'opd' objective's turns without a
    directive hint) is dropped too, counted under the reason the objective gives. `lag`
    measures a sample's staleness otherwise (tenant scope: its tenant's versions since).
    """
    kept = []
    for sample in samples:
        problem = untrainable(sample)
        if problem is not None:
            log.warning("dropping sample %s: %s", sample.key, problem.detail)
            metrics.dropped.labels("invalid").inc()
            continue
        reason = objective.rejects(sample)
        if reason is not None:
            metrics.dropped.labels(reason).inc()
            continue
        behind = lag(sample) if lag is not None else staleness(sample, version)
        if behind > max_staleness:
            metrics.dropped.labels("stale").inc()
            continue
        metrics.staleness.observe(max(behind, 0))
        kept.append(sample)
    return kept


class BatchSource:
    """Reads `liveloop:batches` one entry at a time; bad entries end in the dead-letter stream."""

    def __init__(
        self,
        client: aredis.Redis,
        data_dir: Path,
        settings: ConsumerSettings,
        *,
        max_attempts: int = 3,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.consumer = bus.StreamConsumer(
            client,
            bus.BATCHES,
            bus.TRAINER_GROUP,
            settings.name,
            claim_idle_ms=settings.claim_idle_ms,
            max_attempts=max_attempts,
            count=settings.read_count,
        )
        self._read: deque[Entry] = deque()  # read, not yet handed out

    async def start(self) -> None:
        """Create the consumer group if needed."""
        await self.consumer.ensure_group()

    async def next(self, block_ms: int) -> ReceivedBatch | None:
        """The next readable batch, or None when nothing arrived within `block_ms`."""
        if not self._read:
            self._read.extend(await self.consumer.read(block_ms=block_ms))
        while self._read:
            entry = self._read.popleft()
            file: Path | None = None
            try:
                batch = entry.parse(TrainingBatch)
                if batch.samples is not None:
                    samples = batch.samples
                elif batch.path is not None:
                    file = self.data_dir / batch.path
                    samples = load_batch_file(self.data_dir, batch.path)
                else:
                    raise ValueError("batch has neither samples nor path")
            except (ValidationError, ValueError, OSError) as exc:
                await self.consumer.fail(entry, f"unreadable batch: {exc}")
                continue
            return ReceivedBatch(entry.id, batch, samples, file)
        return None

    async def done(self, item: ReceivedBatch) -> None:
        """Acknowledge a batch whose effect is durable, and remove its file."""
        await self.consumer.ack(item.entry_id)
        if item.file is not None:
            item.file.unlink(missing_ok=True)


class Publisher:
    """Records versions in the registry and announces them through the weight transport."""

    def __init__(self, transport: WeightTransport, registry: Registry, run_id: int | None) -> None:
        self.transport = transport
        self.registry = registry
        self.run_id = run_id

    def record(
        self,
        version: int,
        path: Path,
        parent: int | None,
        metrics: dict[str, float],
        *,
        status: VersionStatus = VersionStatus.ACCEPTED,
        reason: str | None = None,
    ) -> None:
        """Add the version to the registry (a no-op if it is there already)."""
        meta = adapter_meta(path)
        self.registry.add_model_version(
            version, str(path), parent, metrics, run_id=self.run_id, status=status,
            reason=reason, adapter=meta["adapter"], tenant=meta["tenant"],
        )  # fmt: skip

    async def announce(
        self,
        version: int,
        path: Path,
        parent: int | None,
        metrics: dict[str, float],
        *,
        status: VersionStatus = VersionStatus.ACCEPTED,
        reason: str | None = None,
    ) -> bool:
        """Announce the version; False when this (version, path) was announced before.

        A rejected version is announced too, so that every server can show it as refused.
        """
        meta = adapter_meta(path)
        adapter = meta["adapter"]
        payload = WeightsAnnouncement(
            version=version,
            path=str(path),
            parent=parent,
            metrics=metrics,
            status=status,
            reason=reason,
            kind="adapter" if adapter is not None else "full",
            adapter=adapter,
            tenant=meta["tenant"],
        )
        return await self.transport.announce(payload)

    async def publish(
        self, state: TrainerState, path: Path, probe: dict[str, Any] | None = None
    ) -> None:
        """Record a trained version (and its gate probe, if any) in the registry, announce it."""
        status = state.status
        await asyncio.to_thread(
            self.record,
            state.version,
            path,
            state.parent,
            state.metrics,
            status=status,
            reason=state.reason,
        )
        if probe is not None:
            probe = {**probe, "status": str(status), "reason": state.reason}  # outlives its row
            await asyncio.to_thread(
                self.registry.record_version_quality, state.version, probe=probe
            )
        await self.announce(
            state.version, path, state.parent, state.metrics, status=status, reason=state.reason
        )

    def mark_rolled_back(self, reasons: dict[int, str]) -> None:
        """Record that these served versions were rolled back (served-quality watch), and why."""
        for version, reason in reasons.items():
            self.registry.set_model_version_status(version, VersionStatus.ROLLED_BACK, reason)

    def forget(
        self,
        on_disk: frozenset[int],
        keep: frozenset[int] = frozenset(),
        *,
        tenant: str | None = None,
    ) -> list[int]:
        """Drop the accepted versions whose checkpoints are gone from the registry; returns
        them.

        Refused and rolled-back versions stay, with their reason: the record of a refusal
        matters more than the checkpoint it refused. A version in `keep` (one the
        served-quality watch has yet to judge) stays until it is no longer there: if the
        watch finds it bad, the rollback's record needs its row, checkpoint or not. With
        `tenant`, only that tenant's versions are looked at (`on_disk` is its own).
        """
        accepted = self.registry.list_model_versions(status=VersionStatus.ACCEPTED, tenant=tenant)
        gone = sorted(v.version for v in accepted if v.version not in on_disk | keep)
        for version in gone:
            self.registry.delete_model_version(version)
        return gone

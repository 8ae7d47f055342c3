"""Writing batches to `liveloop:batches` exactly once, inline or by reference to a file.

A batch's id is a hash of its turn keys, and one exactly-once write (`bus.ExactlyOnce`),
atomically: refuses the batch when its id was published before (the dedupe key) or when
any of its turns is already part of a published batch (the member set); otherwise XADDs the
entry and records every turn key in the member set. So a turn re-delivered after a crash,
or reclaimed by a second collector, is never trained twice.
A batch over `inline_max_bytes` is written (atomically) to `<data-dir>/batches/<id>.json`
first; the entry then carries that path relative to the data dir.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aredis

from liveloop import bus
from liveloop.bus import keys
from liveloop.bus.consumer import group_info
from liveloop.contracts import BatchSample, TrainingBatch

BATCHES_SUBDIR = "batches"


def batch_id_for(keys: Sequence[str]) -> str:
    """Deterministic id of a batch: the same turns always give the same id."""
    digest = hashlib.sha256("\n".join(sorted(keys)).encode()).hexdigest()
    return f"b-{digest[:24]}"


@dataclass
class WriteResult:
    """Outcome of one batch write."""

    status: str  # "ok", "dup" (this exact batch exists) or "taken" (a turn is in another)
    batch: TrainingBatch
    entry_id: str | None = None
    taken_key: str | None = None


class BatchWriter:
    """Publishes batches once; knows which turn keys are already batched."""

    def __init__(
        self, client: aredis.Redis, data_dir: Path, inline_max_bytes: int = 4 * 1024 * 1024
    ) -> None:
        self.client = client
        self.data_dir = Path(data_dir)
        self.inline_max_bytes = inline_max_bytes
        self.stream = bus.stream_key(bus.BATCHES)
        self.members_key = keys.batch_members()
        self.once = bus.ExactlyOnce(client)

    async def already_batched(self, keys: Sequence[str]) -> set[str]:
        """The subset of turn keys that are part of a published batch."""
        if not keys:
            return set()
        scores = await self.client.zmscore(self.members_key, list(keys))
        return {k for k, s in zip(keys, scores, strict=True) if s is not None}

    async def waiting(self) -> int:
        """Published batches the trainer has not read yet (all of them before its group
        exists: a new group reads the stream from its start)."""
        info = await group_info(self.client, self.stream, bus.TRAINER_GROUP)
        if info is not None:
            # Redis cannot count the lag when entries were deleted mid-range; entries are
            # deleted only after they were read, so that case is taken as none waiting.
            return int(info.get("lag") or 0)
        return int(await self.client.xlen(self.stream))  # 0 when there is no stream yet

    def _spill(self, batch: TrainingBatch) -> Path:
        """Write the samples to a file (atomically); returns its path relative to the data dir."""
        rel = Path(BATCHES_SUBDIR) / f"{batch.batch_id}.json"
        full = self.data_dir / rel
        full.parent.mkdir(parents=True, exist_ok=True)
        tmp = full.with_suffix(f".tmp-{os.getpid()}")
        with open(tmp, "wb") as fh:
            fh.write(batch.model_dump_json().encode())
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(full)
        return rel

    async def write(
        self, samples: list[BatchSample], trainer_version: int, *, tenant: str | None = None
    ) -> WriteResult:
        """Publish one batch (by reference when large) unless it or a turn of it exists
        (`tenant`: the one tenant whose turns it holds, in tenant scope)."""
        turn_keys = [s.key for s in samples]
        batch = TrainingBatch(
            batch_id=batch_id_for(turn_keys),
            trainer_version=trainer_version,
            num_tokens=sum(s.num_tokens for s in samples),
            samples=samples,
            tenant=tenant,
        )
        payload = batch.model_dump_json()
        spilled: Path | None = None
        existed = False
        if len(payload) > self.inline_max_bytes:
            existed = (self.data_dir / BATCHES_SUBDIR / f"{batch.batch_id}.json").exists()
            spilled = self._spill(batch)
            batch = batch.model_copy(update={"samples": None, "path": str(spilled)})
            payload = batch.model_dump_json()
        fields = {"data": payload, "batch_id": batch.batch_id, "num_tokens": str(batch.num_tokens)}
        if tenant is not None:  # an index field: a tenant's batches found without decoding
            fields["tenant"] = tenant
        result = await self.once.write(
            self.stream, batch.batch_id, fields, members=turn_keys, member_set=self.members_key
        )
        if not result.written and spilled is not None and not existed:
            # Ours alone: a "dup" whose file still exists shares it with the earlier entry.
            (self.data_dir / spilled).unlink(missing_ok=True)
        return WriteResult(result.status, batch, entry_id=result.entry_id, taken_key=result.taken)

"""Checkpoints on disk: servable weights plus the state a restarted trainer resumes from.

The servable part, and writing it atomically, is the weight transport's
(`liveloop.weights.SharedDiskTransport`, whose docstring describes the format); this
module adds the trainer's own state inside each version directory:

    v<N>/trainer_state/state.json  version, parent, recently applied batch ids
    v<N>/trainer_state/optimizer.pt
    v<N>/trainer_state/adapter/    LoRA adapter (when training LoRA and publishing merged
                                   weights; a version published as an adapter is one itself)

A version counts as a checkpoint once its `state.json` is there. Only the newest `keep`
are kept.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from liveloop.contracts import VersionStatus
from liveloop.weights import SharedDiskTransport

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

STATE_DIR = "trainer_state"
# Batch ids remembered in a checkpoint, so a batch re-delivered after a crash is not re-applied.
APPLIED_BATCHES_KEPT = 1000


@dataclass
class TrainerState:
    """What a restarted trainer needs besides weights and optimizer state."""

    version: int
    parent: int | None
    applied_batches: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    status: VersionStatus = VersionStatus.ACCEPTED
    reason: str | None = None
    resume_from: int | None = None  # whose weights training went on from after this version

    def next_start(self) -> int | None:
        """The version training goes on from after this one (None: not recorded)."""
        if self.resume_from is not None:
            return self.resume_from
        return self.version if self.status.servable else None

    def __post_init__(self) -> None:
        self.status = VersionStatus(self.status)  # read back from JSON as a plain string


class CheckpointStore:
    """Writes, finds, loads and prunes `v<N>` checkpoint directories."""

    def __init__(self, root: Path, keep: int) -> None:
        self.root = Path(root)
        self.keep = keep
        self.transport = SharedDiskTransport(self.root)

    def path_for(self, version: int) -> Path:
        """Directory of a version's checkpoint (absolute)."""
        return self.transport.path_for(version)

    def versions(self) -> list[int]:
        """Complete checkpoints on disk, oldest first."""
        found = self.transport.version_dirs()
        return sorted(v for v, d in found.items() if (d / STATE_DIR / "state.json").is_file())

    def latest(self, *, accepted_only: bool = False) -> int | None:
        """The newest complete checkpoint's version (optionally the newest accepted), or None."""
        found = self.versions()
        if accepted_only:
            found = [v for v in found if self.load_state(v).status.servable]
        return found[-1] if found else None

    def resume_point(self) -> int | None:
        """The version a restarted trainer goes on from: what the newest checkpoint says
        training went on from after it (a refused version's predecessor, say), if that is
        still on disk; else the newest accepted one. None: the base model."""
        newest = self.latest()
        if newest is None:
            return None
        start = self.load_state(newest).next_start()
        if start is not None and (start == 0 or start in self.versions()):
            return start or None
        return self.latest(accepted_only=True)

    def save(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        optimizer: torch.optim.Optimizer,
        state: TrainerState,
        adapter: Any | None = None,
        *,
        publish_adapter: str | None = None,
        tenant: str | None = None,
    ) -> Path:
        """Write version `state.version` atomically; returns its directory.

        `model` is the servable weights and `adapter` the peft model trained (LoRA), kept
        beside them to resume from; with `publish_adapter` (its name) the version is the
        adapter alone, and `model` is not written (`tenant`: whose adapter it is, in tenant
        scope).
        """
        import torch

        def add_trainer_state(directory: Path) -> None:
            state_dir = directory / STATE_DIR
            state_dir.mkdir()
            torch.save(optimizer.state_dict(), state_dir / "optimizer.pt")
            if adapter is not None and publish_adapter is None:
                adapter.save_pretrained(str(state_dir / "adapter"))
            state.applied_batches = state.applied_batches[-APPLIED_BATCHES_KEPT:]
            (state_dir / "state.json").write_text(json.dumps(asdict(state)))

        if publish_adapter is not None:
            assert adapter is not None, "publishing an adapter needs the peft model"
            path = self.transport.write_adapter(
                state.version, adapter, publish_adapter, add_trainer_state, tenant=tenant
            )
            return Path(path)
        return Path(self.transport.write(state.version, model, tokenizer, add_trainer_state))

    def load_state(self, version: int) -> TrainerState:
        """The trainer state saved with a version."""
        raw = json.loads((self.path_for(version) / STATE_DIR / "state.json").read_text())
        return TrainerState(**raw)

    def load_optimizer(self, version: int, optimizer: torch.optim.Optimizer) -> None:
        """Restore the optimizer state saved with a version."""
        import torch

        path = self.path_for(version) / STATE_DIR / "optimizer.pt"
        optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    def prune(self, protect: frozenset[int] = frozenset()) -> list[int]:
        """Delete all but the newest `keep` checkpoints and `protect` (the last accepted one,
        which a refused successor must be able to revert to); returns the deleted versions."""
        found = self.versions()
        doomed = [v for v in found[: max(len(found) - self.keep, 0)] if v not in protect]
        for version in doomed:
            shutil.rmtree(self.path_for(version), ignore_errors=True)
        if self.root.is_dir():
            self.transport.clean_scratch()
        return doomed

"""Checkpoints on disk: servable weights plus the state a restarted trainer resumes from.

Layout under `settings.checkpoints_dir`:

    v<N>/                       what `AutoModelForCausalLM.from_pretrained` loads (the server)
      config.json, model.safetensors, generation_config.json, tokenizer files
      trainer_state/state.json  version, parent, recently applied batch ids
      trainer_state/optimizer.pt
      trainer_state/adapter/    LoRA adapter (only when training LoRA)

A checkpoint is written into a hidden temporary directory and renamed into place, so a
`v<N>` directory always holds a complete checkpoint. Only the newest `keep` are kept.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

_VERSION_DIR = re.compile(r"^v(\d+)$")
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
    status: str = "accepted"  # "rejected": refused by the promotion gate, never served
    reason: str | None = None


class CheckpointStore:
    """Writes, finds, loads and prunes `v<N>` checkpoint directories."""

    def __init__(self, root: Path, keep: int) -> None:
        self.root = Path(root)
        self.keep = keep
        self._tokenizer_dir: Path | None = None

    def path_for(self, version: int) -> Path:
        """Directory of a version's checkpoint (absolute)."""
        return (self.root / f"v{version}").resolve()

    def versions(self) -> list[int]:
        """Complete checkpoints on disk, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = _VERSION_DIR.match(child.name)
            if match and (child / STATE_DIR / "state.json").is_file():
                found.append(int(match.group(1)))
        return sorted(found)

    def latest(self, *, accepted_only: bool = False) -> int | None:
        """The newest complete checkpoint's version (optionally the newest accepted), or None."""
        found = self.versions()
        if accepted_only:
            found = [v for v in found if self.load_state(v).status == "accepted"]
        return found[-1] if found else None

    def save(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        optimizer: torch.optim.Optimizer,
        state: TrainerState,
        adapter: Any | None = None,
    ) -> Path:
        """Write version `state.version` atomically; returns its directory."""
        import torch

        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path_for(state.version)
        tmp = self.root / f".v{state.version}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            model.save_pretrained(str(tmp))
            self._link_tokenizer(tokenizer, tmp)
            state_dir = tmp / STATE_DIR
            state_dir.mkdir()
            torch.save(optimizer.state_dict(), state_dir / "optimizer.pt")
            if adapter is not None:
                adapter.save_pretrained(str(state_dir / "adapter"))
            state.applied_batches = state.applied_batches[-APPLIED_BATCHES_KEPT:]
            (state_dir / "state.json").write_text(json.dumps(asdict(state)))
            if final.exists():
                log.warning("replacing existing checkpoint %s", final)
                shutil.rmtree(final)
            tmp.rename(final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return final

    def _link_tokenizer(self, tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
        """Tokenizer files into `target`: serialised once per process, then hard-linked."""
        cache = self.root / f".tokenizer-{os.getpid()}"
        if self._tokenizer_dir != cache:
            shutil.rmtree(cache, ignore_errors=True)
            tokenizer.save_pretrained(str(cache))
            self._tokenizer_dir = cache
        for item in cache.iterdir():
            try:
                os.link(item, target / item.name)
            except OSError:  # no hard links on this filesystem
                shutil.copy2(item, target / item.name)

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
        for tmp in [*self.root.glob(".v*.tmp-*"), *self.root.glob(".tokenizer-*")]:
            if not tmp.name.endswith(f"-{os.getpid()}"):  # left behind by a dead trainer
                shutil.rmtree(tmp, ignore_errors=True)
        return doomed

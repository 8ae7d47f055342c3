"""Weight transport: how a policy version travels from the trainer to every engine serving it.

One small interface, `WeightTransport`, is the seam between the trainer and the engines:
the trainer `write`s a version and `announce`s it (the two are separate so that a
promotion gate can sit between them); a server follows the announcements (`latest`,
`updates`) and its engine `validate`s and `load`s what one points at. `setup_weight_transport`
builds the one implementation there is today, `SharedDiskTransport`.

Checkpoint format (`SharedDiskTransport`): a version is a full Hugging Face model directory
on a disk every reader sees, `<checkpoints dir>/v<N>/`:

    config.json, generation_config.json   the model's configuration
    model.safetensors                     the weights (or model-0000i-of-0000n.safetensors
                                          shards listed in model.safetensors.index.json)
    tokenizer.json, tokenizer_config.json, special_tokens_map.json, ...
                                          the tokenizer, unchanged from the base model
    trainer_state/                        the trainer's own resume state (ignored by engines)

so `AutoModelForCausalLM.from_pretrained`, SGLang and vLLM load it as it is. Weights are
plain full tensors (LoRA merged in), or, for a version published as an adapter
(`write_adapter`), the adapter alone in the PEFT layout:

    adapter_config.json, adapter_model.safetensors     what PeftModel.save_pretrained writes
    liveloop_adapter.json                              {"adapter": name, "version": N}
    trainer_state/                                     as above

which SGLang (`/load_lora_adapter`), vLLM and LiveLoop's torch engine load over the base
model. A directory is written under a hidden temporary name and renamed into place, so a
`v<N>` directory is always complete.
Announcements are `WeightsAnnouncement` entries on `liveloop:weights`, exactly once per
(version, path); a reader also accepts a single `.safetensors` file (an operator's
`POST /admin/weights`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis.asyncio as aredis

from liveloop.bus import WEIGHTS, publish
from liveloop.contracts import WeightsAnnouncement
from liveloop.weights.adapter import is_adapter_dir, read_adapter
from liveloop.weights.announcements import (
    decode_announcements,
    latest_announcement,
    recent_announcements,
    weights_stream,
)
from liveloop.weights.checkpoint import check_checkpoint, load_checkpoint_state_dict

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

RECENT = 16  # announcements a new follower looks back over
ADAPTER_META = "liveloop_adapter.json"  # which adapter, which version (beside PEFT's files)
_VERSION_DIR = re.compile(r"^v(\d+)$")


def adapter_meta(location: str | Path) -> dict[str, str | None]:
    """What `liveloop_adapter.json` says of a version directory: {"adapter", "tenant"}
    (both None for full weights)."""
    meta = Path(location) / ADAPTER_META
    found: dict[str, str | None] = {"adapter": None, "tenant": None}
    if not meta.is_file():
        return found
    try:
        raw = json.loads(meta.read_text())
    except (OSError, ValueError):
        return found
    if isinstance(raw, dict):
        for key in found:
            value = raw.get(key)
            found[key] = str(value) if value else None
    return found


def adapter_name_of(location: str | Path) -> str | None:
    """The adapter a version directory holds (`liveloop_adapter.json`), or None for weights."""
    return adapter_meta(location)["adapter"]


class WeightTransport(ABC):
    """Writing, announcing, following, validating and loading policy versions."""

    @abstractmethod
    def write(
        self,
        version: int,
        model: Any,
        tokenizer: Any,
        extra: Callable[[Path], None] | None = None,
    ) -> str:
        """Store a servable version (a transformers model and its tokenizer); its location.

        `extra(directory)` may add files before the version becomes visible (the trainer's
        resume state).
        """

    @abstractmethod
    async def announce(self, announcement: WeightsAnnouncement) -> bool:
        """Tell every server about a version; False when it was announced before."""

    @abstractmethod
    async def latest(self) -> WeightsAnnouncement | None:
        """The newest announcement, or None when nothing was announced yet."""

    @abstractmethod
    async def updates(
        self, cursor: str | None, block_ms: int
    ) -> tuple[str, list[WeightsAnnouncement]]:
        """Announcements after `cursor` (None: the recent ones), waiting up to `block_ms`.

        Returns the cursor to pass next time and the announcements (in any order).
        """

    @abstractmethod
    def validate(self, location: str) -> None:
        """Raise CheckpointError unless `location` holds a complete, readable checkpoint."""

    @abstractmethod
    def load(self, location: str) -> dict[str, torch.Tensor]:
        """Every tensor of a checkpoint on CPU, checked (complete, finite); CheckpointError."""


class SharedDiskTransport(WeightTransport):
    """Hugging Face model directories on a shared disk, announced on `liveloop:weights`.

    `root` (the checkpoints dir) is needed to write, `client` to announce or follow;
    validating and loading need neither.
    """

    def __init__(self, root: Path | None = None, client: aredis.Redis | None = None) -> None:
        self.root = Path(root) if root is not None else None
        self.client = client
        self._tokenizer_dir: Path | None = None

    def _root(self) -> Path:
        if self.root is None:
            raise RuntimeError("this weight transport has no checkpoints dir to write to")
        return self.root

    def _client(self) -> aredis.Redis:
        if self.client is None:
            raise RuntimeError("this weight transport has no Redis client")
        return self.client

    def path_for(self, version: int) -> Path:
        """Directory of a version (absolute)."""
        return (self._root() / f"v{version}").resolve()

    def version_dirs(self) -> dict[int, Path]:
        """Every `v<N>` directory under the root, by version."""
        root = self._root()
        if not root.is_dir():
            return {}
        found: dict[int, Path] = {}
        for child in root.iterdir():
            match = _VERSION_DIR.match(child.name)
            if match:
                found[int(match.group(1))] = child
        return found

    def write(
        self,
        version: int,
        model: Any,
        tokenizer: Any,
        extra: Callable[[Path], None] | None = None,
    ) -> str:
        """Write `v<version>/` atomically (temporary dir, then rename); its absolute path."""

        def fill(tmp: Path) -> None:
            model.save_pretrained(str(tmp))
            self._link_tokenizer(tokenizer, tmp)

        return self._write_atomically(version, fill, extra)

    def write_adapter(
        self,
        version: int,
        adapter_model: Any,
        adapter: str,
        extra: Callable[[Path], None] | None = None,
        tenant: str | None = None,
    ) -> str:
        """Write `v<version>/` as a PEFT adapter (a peft model's trainable adapter only),
        named `adapter` (`tenant`'s, in tenant scope), atomically; its absolute path."""

        def fill(tmp: Path) -> None:
            adapter_model.save_pretrained(str(tmp))
            meta = {"adapter": adapter, "version": version, "tenant": tenant}
            (tmp / ADAPTER_META).write_text(json.dumps(meta))

        return self._write_atomically(version, fill, extra)

    def _write_atomically(
        self,
        version: int,
        fill: Callable[[Path], None],
        extra: Callable[[Path], None] | None,
    ) -> str:
        """`fill` then `extra` write into a temporary directory, renamed to `v<version>/`
        (replacing one there); a failure leaves no partial directory. Its absolute path."""
        root = self._root()
        root.mkdir(parents=True, exist_ok=True)
        final = self.path_for(version)
        tmp = root / f".v{version}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            fill(tmp)
            if extra is not None:
                extra(tmp)
            if final.exists():
                log.warning("replacing existing checkpoint %s", final)
                shutil.rmtree(final)
            tmp.rename(final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return str(final)

    def _link_tokenizer(self, tokenizer: Any, target: Path) -> None:
        """Tokenizer files into `target`: serialised once per process, then hard-linked."""
        cache = self._root() / f".tokenizer-{os.getpid()}"
        if self._tokenizer_dir != cache:
            shutil.rmtree(cache, ignore_errors=True)
            tokenizer.save_pretrained(str(cache))
            self._tokenizer_dir = cache
        for item in cache.iterdir():
            try:
                os.link(item, target / item.name)
            except OSError:  # no hard links on this filesystem
                shutil.copy2(item, target / item.name)

    def clean_scratch(self) -> None:
        """Remove temporary dirs and tokenizer caches left behind by dead writers."""
        root = self._root()
        for tmp in [*root.glob(".v*.tmp-*"), *root.glob(".tokenizer-*")]:
            if not tmp.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(tmp, ignore_errors=True)

    async def announce(self, announcement: WeightsAnnouncement) -> bool:
        """XADD the announcement once per (version, path)."""
        entry = await publish(
            self._client(),
            WEIGHTS,
            announcement,
            dedupe_key=f"v{announcement.version}:{announcement.path}",
            version=announcement.version,
        )
        return entry is not None

    async def latest(self) -> WeightsAnnouncement | None:
        """The newest readable announcement on `liveloop:weights`."""
        return await latest_announcement(self._client(), RECENT)

    async def updates(
        self, cursor: str | None, block_ms: int
    ) -> tuple[str, list[WeightsAnnouncement]]:
        """XREVRANGE of the recent announcements first, then a blocking XREAD after `cursor`."""
        client = self._client()
        if cursor is None:
            newest, found = await recent_announcements(client, RECENT)
            return newest or "0-0", found
        reply: Any = await client.xread({weights_stream(): cursor}, count=64, block=block_ms)
        entries: list[tuple[str, dict[str, str]]] = []
        for _stream, items in reply or []:
            for entry_id, fields in items:
                cursor = str(entry_id)
                entries.append((cursor, fields))
        return cursor, decode_announcements(entries)

    def validate(self, location: str) -> None:
        """Files present and safetensors headers readable (no tensor is read); an adapter
        directory is read whole and checked (its tensors are small)."""
        if is_adapter_dir(location):
            read_adapter(location)
            return
        check_checkpoint(location)

    def load(self, location: str) -> dict[str, torch.Tensor]:
        """Every tensor, on CPU, refusing missing shards and NaN/inf values."""
        return load_checkpoint_state_dict(location)


def setup_weight_transport(
    root: Path | None = None, client: aredis.Redis | None = None
) -> WeightTransport:
    """The weight transport of this deployment (shared disk + `liveloop:weights` today)."""
    return SharedDiskTransport(root, client)

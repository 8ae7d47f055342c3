"""LoRA adapters across the SGLang replicas, through SGLang's own multi-LoRA serving.

Each adapter version is loaded into every replica under a versioned SGLang name,
`<adapter>@v<N>` (`/load_lora_adapter`), one replica at a time, and a request on the
adapter carries the name its replica serves as `lora_path`: base weights never pause, and
requests already running on the previous version finish on it. A superseded version is
unloaded from a replica (`/unload_lora_adapter`) once no request of the gateway uses it
there. A replica that fails to load a version keeps serving the previous one, is counted,
and is retried with backoff; the version is refused (AdapterError) only when no replica
took it. A replica that comes back after being down gets every adapter again.

The gateway checks an adapter before any replica sees it (`validate_adapter`: PEFT layout,
names and shapes against the served model, rank and target modules within the servers'
limits, no NaN/inf), with the standard library and numpy only: this process never imports
torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from liveloop.server.engine.sglang.checkpoints import TensorInfo, check_finite, read_header
from liveloop.server.engine.sglang.client import ReplicaUnavailable, RequestRefused
from liveloop.server.engine.types import EngineError, UnknownAdapterError
from liveloop.weights import CheckpointError
from liveloop.weights.adapter import (
    ADAPTER_WEIGHTS,
    AdapterConfig,
    AdapterError,
    check_adapter_layout,
    read_adapter_config,
)

if TYPE_CHECKING:
    from liveloop.config import SGLangConfig
    from liveloop.server.engine.sglang.pool import Replica, ReplicaPool

log = logging.getLogger(__name__)


def lora_name(adapter: str, version: int) -> str:
    """The SGLang name of one adapter version."""
    return f"{adapter}@v{version}"


def validate_adapter(
    path: Path, base: dict[str, TensorInfo], cfg: SGLangConfig, scan: bool = True
) -> AdapterConfig:
    """Refuse an adapter the replicas could not load or that would serve garbage."""
    config = read_adapter_config(path)
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise AdapterError(f"{path} has no {ADAPTER_WEIGHTS}")
    try:
        tensors = read_header(weights)
    except CheckpointError as exc:
        raise AdapterError(str(exc)) from None
    layout = check_adapter_layout(
        config,
        {name: info.shape for name, info in tensors.items()},
        {name: info.shape for name, info in base.items()},
    )
    for module, info in layout.items():
        if info.rank > cfg.max_lora_rank:
            raise AdapterError(
                f"{module} has rank {info.rank}; the servers take at most {cfg.max_lora_rank} "
                "(server.sglang.max_lora_rank)"
            )
        if module.rsplit(".", 1)[-1] not in cfg.lora_target_modules:
            raise AdapterError(
                f"the servers cannot adapt {module} (server.sglang.lora_target_modules: "
                f"{', '.join(cfg.lora_target_modules)})"
            )
    if scan:
        for name, tensor in tensors.items():
            try:
                check_finite(tensor, name)
            except CheckpointError as exc:
                raise AdapterError(str(exc)) from None
    return config


class LoadFailed(RuntimeError):
    """One replica did not load an adapter version."""


@dataclass(frozen=True)
class Lease:
    """A request's use of one adapter version on one replica."""

    replica: Replica
    lora: str
    version: int


class AdapterRollout:
    """Which adapter versions the replicas should serve, and getting them there."""

    def __init__(
        self, pool: ReplicaPool, *, timeout_s: float, backoff_s: tuple[float, float]
    ) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.targets: dict[str, tuple[int, str]] = {}  # adapter -> (version, path to load)
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._retries: dict[Replica, asyncio.Task[None]] = {}
        self._backoff: dict[Replica, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def versions(self) -> dict[str, int]:
        """Adapter name -> the version served (by every replica that could load it)."""
        return {name: version for name, (version, _) in self.targets.items()}

    async def stop(self) -> None:
        """Cancel retries and pending unloads."""
        tasks = [*self._retries.values(), *self._tasks]
        self._retries.clear()
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ----------------------------------------------------------------- requests
    def acquire(self, replica: Replica, adapter: str) -> Lease | None:
        """Use the version `replica` serves of `adapter` (None: it serves none)."""
        version = replica.loras.served.get(adapter)
        if version is None:
            return None
        lora = lora_name(adapter, version)
        replica.loras.users[lora] = replica.loras.users.get(lora, 0) + 1
        return Lease(replica, lora, version)

    def release(self, lease: Lease) -> None:
        """A request is done with its lease; a superseded version unused now is unloaded."""
        state = lease.replica.loras
        left = state.users.get(lease.lora, 1) - 1
        if left > 0:
            state.users[lease.lora] = left
            return
        state.users.pop(lease.lora, None)
        if lease.lora in state.stale:
            self._spawn(self._unload_if_unused(lease.replica, lease.lora))

    # ----------------------------------------------------------------- versions
    async def load(self, adapter: str, version: int, path: str) -> float:
        """Load a version into every healthy replica, one at a time; the longest load (s).

        Raises AdapterError when no replica took it (the previous version stays).
        """
        async with self._lock:
            healthy = [r for r in self.pool.replicas if r.healthy]
            if not healthy:
                raise EngineError("no SGLang replica is available")
            previous = self.targets.get(adapter)
            self.targets[adapter] = (version, path)
            longest, failures = 0.0, []
            for replica in healthy:
                try:
                    longest = max(longest, await self._load_one(replica, adapter, version, path))
                except LoadFailed as exc:
                    failures.append((replica, exc))
            if len(failures) == len(healthy):
                if previous is None:
                    del self.targets[adapter]
                else:
                    self.targets[adapter] = previous
                raise AdapterError(
                    f"no SGLang replica could load adapter {adapter} v{version}: {failures[0][1]}"
                )
            for replica, failure in failures:
                self._failed(replica, adapter, version, failure)
            return longest

    async def unload(self, adapter: str) -> None:
        """Stop serving an adapter; its versions leave each replica once unused there."""
        async with self._lock:
            if self.targets.pop(adapter, None) is None:
                raise UnknownAdapterError(f"adapter {adapter!r} is not loaded")
            for replica in self.pool.replicas:
                version = replica.loras.served.pop(adapter, None)
                if version is not None:
                    self._retire(replica, lora_name(adapter, version))

    async def recover(self, replica: Replica) -> None:
        """A replica is back after being down: forget what it lost (a restarted server has
        no adapters), then give it every adapter it lacks."""
        async with self._lock:
            state = replica.loras
            if state.served or state.stale:
                try:
                    loaded = await replica.client.loaded_loras()
                except (ReplicaUnavailable, RequestRefused) as exc:
                    log.warning("cannot list the adapters of %s (%s)", replica.url, exc)
                    loaded = set()
                for adapter, version in list(state.served.items()):
                    if lora_name(adapter, version) not in loaded:
                        del state.served[adapter]
                state.stale &= loaded
                for lora in state.stale:
                    if not state.users.get(lora):
                        self._spawn(self._unload_if_unused(replica, lora))
            await self._catch_up(replica)

    # ----------------------------------------------------------------- internals
    async def _load_one(self, replica: Replica, adapter: str, version: int, path: str) -> float:
        lora = lora_name(adapter, version)
        state = replica.loras
        state.stale.discard(lora)  # a rollback to a version still loaded: keep it
        started = time.perf_counter()
        try:
            ok, message = await replica.client.load_lora(lora, path, self.timeout_s)
        except (ReplicaUnavailable, RequestRefused) as exc:
            ok, message = False, str(exc)
        if not ok and "already loaded" not in message:
            state.loads_failed += 1
            raise LoadFailed(message or "load_lora_adapter failed")
        old = state.served.get(adapter)
        state.served[adapter] = version
        state.loads_ok += 1
        if old is not None and old != version:
            self._retire(replica, lora_name(adapter, old))
        elapsed = time.perf_counter() - started
        log.info("SGLang replica %s serves adapter %s (%.2fs)", replica.url, lora, elapsed)
        return elapsed

    async def _catch_up(self, replica: Replica) -> None:
        """Load the target versions the replica lacks; a failure schedules a retry."""
        for adapter, (version, path) in list(self.targets.items()):
            if replica.loras.served.get(adapter) == version:
                continue
            try:
                await self._load_one(replica, adapter, version, path)
            except LoadFailed as exc:
                self._failed(replica, adapter, version, exc)
                return
        self._backoff.pop(replica, None)

    def _retire(self, replica: Replica, lora: str) -> None:
        replica.loras.stale.add(lora)
        if not replica.loras.users.get(lora):
            self._spawn(self._unload_if_unused(replica, lora))

    async def _unload_if_unused(self, replica: Replica, lora: str) -> None:
        async with self._lock:
            state = replica.loras
            if lora not in state.stale or state.users.get(lora):
                return  # loaded again (a rollback), or in use again
            try:
                ok, message = await replica.client.unload_lora(lora, self.timeout_s)
            except (ReplicaUnavailable, RequestRefused) as exc:
                ok, message = False, str(exc)
            if ok or "does not exist" in message:
                state.stale.discard(lora)
                state.unloads += 1
            else:
                state.unloads_failed += 1
                log.warning("SGLang replica %s did not unload %s: %s", replica.url, lora, message)

    def _failed(self, replica: Replica, adapter: str, version: int, exc: Exception) -> None:
        served = replica.loras.served.get(adapter)
        log.error(
            "SGLang replica %s failed to load adapter %s v%d: %s; it serves %s",
            replica.url, adapter, version, exc, f"v{served}" if served is not None else "none",
        )  # fmt: skip
        if replica in self._retries:
            return
        delay = self._backoff.get(replica, self.backoff_s[0])
        self._backoff[replica] = min(delay * 2, self.backoff_s[1])
        task = asyncio.create_task(self._retry(replica, delay), name=f"lora-retry-{replica.url}")
        self._retries[replica] = task

    async def _retry(self, replica: Replica, delay: float) -> None:
        try:
            await asyncio.sleep(delay)
        finally:
            self._retries.pop(replica, None)
        async with self._lock:
            if replica.healthy:  # else it catches up when it comes back (`recover`)
                await self._catch_up(replica)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

"""Following the weight transport's announcements and hot-swapping each new checkpoint.

The engine reads and checks a checkpoint (file I/O, NaN scan, name/shape/dtype check) off
its decode loop; only the final in-place copy runs between two decode steps, so requests
in flight keep streaming. Every server replica follows the announcements itself
(`WeightTransport.updates`: a plain XREAD of `liveloop:weights`, no consumer group), since
each one must see every announcement. A refused checkpoint is logged and counted, and
serving goes on with the old weights.

An announcement of kind 'adapter' is a LoRA adapter version: it is loaded beside the base
weights under its adapter's name (`load_adapter`), newer than that adapter's version served
now, and the routing table (`liveloop.server.adapters`) then sends the requests of its
tenant (or, for a shared adapter, everyone's) to it. Each adapter has its own version line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram

from liveloop import bus
from liveloop.contracts import WeightsAnnouncement
from liveloop.server.adapters import AdapterRouting
from liveloop.weights import CheckpointError, WeightTransport, setup_weight_transport

log = logging.getLogger(__name__)

PAUSE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DELAY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
HISTORY_LIMIT = 100


class SwappableEngine(Protocol):
    """What the follower needs from an engine (TorchEngine and EngineProcess provide it)."""

    @property
    def version(self) -> int: ...

    async def load_weights(self, path: str, version: int) -> float:
        """Read, check and swap in a checkpoint; the decode pause (s), or CheckpointError."""
        ...

    async def load_adapter(self, name: str, version: int, path: str) -> float:
        """Serve a PEFT adapter as `name`, version `version`; the pause, or CheckpointError."""
        ...

    def adapters(self) -> dict[str, int]:
        """The adapters served: name -> version."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name`."""
        ...


class _FollowerMetrics:
    """The follower's Prometheus metrics, on the registry it was given."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.swaps = Counter(
            "liveloop_weight_swaps",
            "Weight swaps by outcome: ok, or refused (checkpoint unusable, old weights kept).",
            ["outcome"],
            registry=registry,
        )
        for outcome in ("ok", "refused"):
            self.swaps.labels(outcome)
        self.pause_seconds = Histogram(
            "liveloop_weight_swap_pause_seconds",
            "Time the engine's decode loop paused to apply new weights.",
            buckets=PAUSE_BUCKETS,
            registry=registry,
        )
        self.load_seconds = Histogram(
            "liveloop_weight_load_seconds",
            "Time to read and validate a checkpoint off the serving path.",
            buckets=LOAD_BUCKETS,
            registry=registry,
        )
        self.checkpoint_to_serving = Histogram(
            "liveloop_weight_checkpoint_to_serving_seconds",
            "Time from the trainer announcing a version to this replica serving it.",
            buckets=DELAY_BUCKETS,
            registry=registry,
        )


class WeightFollower:
    """Follows liveloop:weights and hot-swaps each announced checkpoint into the engine."""

    def __init__(
        self,
        engine: SwappableEngine,
        redis_url: str | None,
        registry: CollectorRegistry,
        follow: bool = True,
        *,
        block_ms: int = 1000,
        reconnect_initial_s: float = 0.5,
        reconnect_max_s: float = 10.0,
    ) -> None:
        self.engine = engine
        self.redis_url = redis_url
        self.follow = follow and redis_url is not None
        self.metrics = _FollowerMetrics(registry)
        self.block_ms = block_ms
        self.reconnect_initial_s = reconnect_initial_s
        self.reconnect_max_s = reconnect_max_s
        self.history: list[dict[str, Any]] = []
        self.refused: list[dict[str, Any]] = []  # the latest HISTORY_LIMIT refusals
        self.refusals = 0  # every refusal since start
        self.rejected: list[dict[str, Any]] = []  # versions the promotion gate refused
        self.routing = AdapterRouting(engine.adapters)
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._last_id: str | None = None
        self._stopping = False
        self.connected = False

    @property
    def cursor(self) -> str | None:
        """Id of the last announcement read (None before the first read)."""
        return self._last_id

    @property
    def current_version(self) -> int:
        """The policy version the engine serves now."""
        return int(self.engine.version)

    async def start(self) -> None:
        """Start following the weights stream (a no-op when following is off)."""
        if self.follow and self._task is None:
            self._task = asyncio.create_task(self._follow(), name="weight-follower")

    async def stop(self) -> None:
        """Stop following; a swap already handed to the engine completes there."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping = True
        # On Python 3.11 redis-py can swallow a cancellation (asyncio.wait_for around a
        # socket write), so cancel until the task is done; the flag ends it after one read.
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        self._stopping = False
        self.connected = False
        if not task.cancelled() and task.exception() is not None:
            log.error("weight follower failed", exc_info=task.exception())

    async def load(
        self, path: str, version: int | None = None, *, allow_rollback: bool = False
    ) -> int:
        """Load, validate and swap in a checkpoint; the new version, or CheckpointError.

        Announced versions must be newer than the serving one; an operator may roll back to
        an older version explicitly (`allow_rollback`, used by POST /admin/weights).
        """
        async with self._lock:
            current = self.current_version
            target = current + 1 if version is None else version
            try:
                if target <= current and not (allow_rollback and version is not None):
                    raise CheckpointError(
                        f"version {target} is not newer than the serving version {current}"
                    )
                started = time.perf_counter()
                try:
                    pause_s = await self.engine.load_weights(path, target)
                except CheckpointError:
                    raise
                except Exception as exc:
                    raise CheckpointError(f"the engine refused {path}: {exc}") from exc
                self.metrics.load_seconds.observe(time.perf_counter() - started - pause_s)
            except CheckpointError as exc:
                self._record_refusal(path, target, exc)
                raise
            self.metrics.swaps.labels("ok").inc()
            self.metrics.pause_seconds.observe(pause_s)
            entry = {
                "version": target,
                "path": str(path),
                "loaded_at": time.time(),
                "pause_s": pause_s,
            }
            self.history.append(entry)
            del self.history[:-HISTORY_LIMIT]
            log.info(
                "serving policy version %d from %s (paused %.1f ms)", target, path, pause_s * 1e3
            )
            return target

    async def load_adapter(
        self,
        name: str,
        path: str,
        version: int,
        *,
        tenant: str | None = None,
        allow_rollback: bool = False,
    ) -> int:
        """Serve a PEFT adapter directory as adapter `name`, version `version`, for `tenant`
        (None: shared); CheckpointError when refused (the version served before goes on).

        Announced versions must be newer than the adapter's served one; an operator may roll
        one adapter back explicitly (`allow_rollback`), leaving every other as it is.
        """
        async with self._lock:
            current = self.engine.adapters().get(name, -1)
            try:
                if version <= current and not allow_rollback:
                    raise CheckpointError(
                        f"adapter {name!r} version {version} is not newer than {current}"
                    )
                started = time.perf_counter()
                try:
                    pause_s = await self.engine.load_adapter(name, version, path)
                except CheckpointError:
                    raise
                except Exception as exc:
                    raise CheckpointError(f"the engine refused adapter {path}: {exc}") from exc
                self.metrics.load_seconds.observe(time.perf_counter() - started - pause_s)
            except CheckpointError as exc:
                self._record_refusal(path, version, exc, adapter=name)
                raise
            self.metrics.swaps.labels("ok").inc()
            self.metrics.pause_seconds.observe(pause_s)
            self.routing.announced(name, tenant)
            self.history.append({"adapter": name, "tenant": tenant, "version": version,
                                 "path": str(path), "loaded_at": time.time(), "pause_s": pause_s})  # fmt: skip
            del self.history[:-HISTORY_LIMIT]
            log.info("serving adapter %s version %d from %s", name, version, path)
            return version

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name` and route nobody to it."""
        async with self._lock:
            self.routing.forget_adapter(name)
            await self.engine.unload_adapter(name)
            log.info("adapter %s unloaded", name)

    async def withdraw(self, adapter: str | None, tenant: str | None) -> None:
        """An adapter withdrawn (its tenant deleted): unloaded if served, nobody routed to it."""
        if tenant is not None:
            self.routing.forget_tenant(tenant)
        if adapter is not None and adapter in self.engine.adapters():
            await self.unload_adapter(adapter)

    def _record_refusal(
        self, path: str, version: int, exc: Exception, adapter: str | None = None
    ) -> None:
        self.metrics.swaps.labels("refused").inc()
        self.refusals += 1
        refusal = {"version": version, "path": str(path), "at": time.time(), "error": str(exc)}
        if adapter is not None:
            refusal["adapter"] = adapter
        self.refused.append(refusal)
        del self.refused[:-HISTORY_LIMIT]
        log.error("refused checkpoint %s (version %d): %s; still serving version %d",
                  path, version, exc, self.current_version)  # fmt: skip

    async def _follow(self) -> None:
        """Read announcements forever, reconnecting with backoff when Redis drops."""
        assert self.redis_url is not None
        delay = self.reconnect_initial_s
        while not self._stopping:
            client = bus.redis_client(
                self.redis_url, timeout_s=self.block_ms / 1000 + 10.0, connect_timeout_s=5.0
            )
            try:
                await self._read_loop(setup_weight_transport(client=client))
            except (redis.RedisError, OSError) as exc:
                if self.connected:
                    log.warning("lost Redis while following weights: %s", exc)
                self.connected = False
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.reconnect_max_s)
            except Exception:  # a bug must not end following for the server's lifetime
                log.exception("weight follower error; restarting in %.1fs", delay)
                self.connected = False
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.reconnect_max_s)
            else:
                delay = self.reconnect_initial_s
            finally:
                await client.aclose()

    async def _read_loop(self, transport: WeightTransport) -> None:
        """Consider the recent announcements once, then every new one, until stopped."""
        if self._last_id is None:  # first connection: the newest announcements so far
            self._last_id, recent = await transport.updates(None, self.block_ms)
            self.connected = True
            await self._consider(recent, live=False)
        self.connected = True
        while not self._stopping:
            self._last_id, announcements = await transport.updates(self._last_id, self.block_ms)
            if announcements:
                await self._consider(announcements)

    async def _consider(self, announced: list[WeightsAnnouncement], *, live: bool = True) -> None:
        """Load the newest announced version above the serving one (older ones as fallback).

        Versions the promotion gate rejected are never loaded; they are remembered (and
        shown by GET /admin/weights) with the gate's reason. `live`: announced while we
        followed, so the announcement-to-serving delay is counted (a version found at
        start-up may be hours old).
        """
        announcements: list[WeightsAnnouncement] = []
        for ann in announced:
            if ann.withdrawn:
                await self.withdraw(ann.adapter, ann.tenant)
            elif ann.servable:
                announcements.append(ann)
            elif all(r["version"] != ann.version for r in self.rejected):
                self.rejected.append({"version": ann.version, "path": ann.path,
                                      "reason": ann.reason, "adapter": ann.adapter})  # fmt: skip
                del self.rejected[:-HISTORY_LIMIT]
        adapters: dict[str, list[WeightsAnnouncement]] = {}
        for ann in announcements:
            if ann.kind == "adapter" and ann.adapter:
                adapters.setdefault(ann.adapter, []).append(ann)
        for versions in adapters.values():
            await self._consider_adapter(versions, live)
        full = [a for a in announcements if a.kind == "full"]
        for ann in sorted(full, key=lambda a: a.version, reverse=True):
            if ann.version <= self.current_version:
                return
            try:
                await self.load(ann.path, ann.version)
                if live:
                    delay = max(0.0, time.time() - ann.created_at)
                    self.metrics.checkpoint_to_serving.observe(delay)
                return
            except CheckpointError:
                continue  # already logged and counted; try the next newest

    async def _consider_adapter(self, announced: list[WeightsAnnouncement], live: bool) -> None:
        """Load the newest announced version of one adapter above the one served."""
        for ann in sorted(announced, key=lambda a: a.version, reverse=True):
            assert ann.adapter is not None
            if ann.version <= self.engine.adapters().get(ann.adapter, -1):
                return
            try:
                await self.load_adapter(ann.adapter, ann.path, ann.version, tenant=ann.tenant)
                if live:
                    self.metrics.checkpoint_to_serving.observe(
                        max(0.0, time.time() - ann.created_at)
                    )
                return
            except CheckpointError:
                continue  # already logged and counted; try the next newest

"""Rolling weight updates across the SGLang replicas, one replica at a time.

For each replica not yet on the target version: take it out of the pool (its sessions
move to the next replica on the ring), pause its generation (`pause_mode`), have it load
the checkpoint (`update_weights_from_disk`, with the version as its label), continue
generation, check the label through `/model_info`, and put it back. Never more than one
replica is out of the pool for an update (a single replica stays in it: SGLang holds the
requests that arrive while it is paused).

A failed update (SGLang refuses the path, times out, or dies) stops the roll: that
replica stays out of the pool on its old version (unless it is the only one that could
serve), is counted, and is retried with exponential backoff toward the newest target; the
others keep serving. A replica that comes back after being down is brought to the target
before it rejoins. Rolling back (`POST /admin/weights` with an older version) is the same
operation with an older target.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from liveloop.server.engine.sglang.client import ReplicaUnavailable, RequestRefused
from liveloop.server.engine.sglang.pool import Replica, ReplicaPool, parse_version
from liveloop.weights import CheckpointError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """A version to serve: the checkpoint as the replicas see it, and its policy version."""

    path: str
    version: int


class UpdateFailed(RuntimeError):
    """One replica did not end up serving the target."""


class RollingUpdater:
    """Brings every healthy replica to `target`, one at a time; retries failures."""

    def __init__(
        self,
        pool: ReplicaPool,
        *,
        pause_mode: str,
        update_timeout_s: float,
        backoff_s: tuple[float, float],
    ) -> None:
        self.pool = pool
        self.pause_mode = pause_mode
        self.update_timeout_s = update_timeout_s
        self.backoff_s = backoff_s
        self.target: Target | None = None
        self.base_version = 0  # what SGLang's own "default" label means
        self._lock = asyncio.Lock()
        self._retries: dict[Replica, asyncio.Task[None]] = {}
        self._backoff: dict[Replica, float] = {}

    @property
    def version(self) -> int:
        """The newest version a replica in the pool serves (the target when none does)."""
        serving = [r.version for r in self.pool.serving]
        if serving:
            return max(serving)
        return self.target.version if self.target is not None else self.base_version

    async def stop(self) -> None:
        """Cancel pending retries."""
        tasks = list(self._retries.values())
        self._retries.clear()
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ----------------------------------------------------------------- joining
    async def discover(self, replica: Replica) -> None:
        """At start-up: read a replica's version and let it serve if it answers."""
        try:
            await replica.client.health(self.pool.health_timeout_s)
            info = await replica.client.model_info()
        except (ReplicaUnavailable, RequestRefused) as exc:
            self.pool.mark_down(replica, str(exc))
            return
        replica.healthy = True
        replica.version = self._label_version(info.get("weight_version"))
        replica.set_state("serving", in_pool=True)

    async def recover(self, replica: Replica) -> None:
        """A replica answers again after being down: bring it to the target, then serve."""
        info = await replica.client.model_info()
        replica.version = self._label_version(info.get("weight_version"))
        async with self._lock:
            target = self.target
            if target is None or replica.version == target.version:
                replica.set_state("serving", in_pool=True)
                log.info("SGLang replica %s rejoined (policy v%d)", replica.url, replica.version)
                return
            try:
                await self._update_one(replica, target)
            except UpdateFailed as exc:
                self._failed(replica, target, exc)

    # ----------------------------------------------------------------- rolling
    async def roll(self, target: Target) -> float:
        """Bring every replica to `target`; the longest pause (s), or CheckpointError."""
        async with self._lock:
            self.target = target
            return await self._converge(target, raise_on_failure=True)

    async def _converge(self, target: Target, raise_on_failure: bool) -> float:
        longest = 0.0
        # Replicas already out after a failed update go first: no extra capacity is lost.
        order = sorted(self.pool.replicas, key=lambda r: r.state != "failed")
        for replica in order:
            if not replica.healthy:
                continue  # down: brought to the target when it comes back
            if replica.version == target.version and replica.state != "failed":
                continue
            try:
                longest = max(longest, await self._update_one(replica, target))
            except UpdateFailed as exc:
                self._failed(replica, target, exc)
                if raise_on_failure:
                    raise CheckpointError(
                        f"replica {replica.url} could not load {target.path}: {exc}"
                    ) from None
                break
        return longest

    async def _update_one(self, replica: Replica, target: Target) -> float:
        """Pause, update, continue, verify one replica; its pause (s) or UpdateFailed."""
        alone = self.pool.serving == [replica]  # SGLang holds its requests while paused
        replica.set_state("updating", in_pool=alone)
        client = replica.client
        started = time.perf_counter()
        try:
            replica.pauses += 1
            await client.pause(self.pause_mode)
            try:
                ok, message = await client.update_weights(
                    target.path,
                    str(target.version),
                    flush_cache=self.pause_mode != "in_place",
                    timeout_s=self.update_timeout_s,
                )
            finally:
                with contextlib.suppress(ReplicaUnavailable, RequestRefused):
                    await client.resume()
            pause = time.perf_counter() - started
            if not ok:
                raise UpdateFailed(message or "update_weights_from_disk failed")
            label = (await client.model_info()).get("weight_version")
        except (ReplicaUnavailable, RequestRefused) as exc:
            raise UpdateFailed(str(exc)) from None
        if parse_version(label) != target.version:
            raise UpdateFailed(f"after the update /model_info reports version {label!r}")
        replica.version = target.version
        replica.updates_ok += 1
        replica.last_error = ""
        self._backoff.pop(replica, None)
        replica.set_state("serving", in_pool=True)
        log.info(
            "SGLang replica %s serves policy v%d (paused %.2fs)", replica.url, target.version, pause
        )
        return pause

    def _failed(self, replica: Replica, target: Target, exc: Exception) -> None:
        """Keep the replica out (unless nothing else serves) and schedule a retry."""
        replica.updates_failed += 1
        replica.last_error = str(exc)
        log.error(
            "SGLang replica %s failed to load v%d from %s: %s; it stays on v%d",
            replica.url, target.version, target.path, exc, replica.version,
        )  # fmt: skip
        if replica.healthy:
            others = [r for r in self.pool.serving if r is not replica]
            # SGLang changes the label only on success: the old weights are still loaded.
            replica.set_state("failed", in_pool=not others)
        self._schedule_retry(replica)

    def _schedule_retry(self, replica: Replica) -> None:
        if replica in self._retries:
            return
        delay = self._backoff.get(replica, self.backoff_s[0])
        self._backoff[replica] = min(delay * 2, self.backoff_s[1])
        task = asyncio.create_task(self._retry(replica, delay), name=f"sglang-retry-{replica.url}")
        self._retries[replica] = task

    async def _retry(self, replica: Replica, delay: float) -> None:
        try:
            await asyncio.sleep(delay)
        finally:
            self._retries.pop(replica, None)
        async with self._lock:
            target = self.target
            if target is None or not replica.healthy or replica.state != "failed":
                return
            log.info("retrying SGLang replica %s on v%d", replica.url, target.version)
            try:
                await self._update_one(replica, target)
            except UpdateFailed as exc:
                self._failed(replica, target, exc)
                return
            await self._converge(target, raise_on_failure=False)

    def _label_version(self, label: object) -> int:
        version = parse_version(label)
        return self.base_version if version is None else version

"""The SGLang replicas behind the gateway: who is healthy, who serves, where a session goes.

A replica serves requests only while it is *in the pool*: healthy, and on the version the
pool should serve. Sessions stick to replicas by consistent hashing of the session id
(so a session's prefix cache is reused); when its replica leaves the pool, a session moves
to the next one on the ring, and comes back when the replica returns. Health is checked
in the background: a refused connection takes a replica out at once, `health_failures`
consecutive failed checks otherwise; a replica that answers again is handed to
`on_recovered` (the rolling updater brings it to the served version) before it rejoins.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from liveloop.server.engine.sglang.client import ReplicaUnavailable, SGLangClient

log = logging.getLogger(__name__)

VIRTUAL_NODES = 64


def parse_version(label: object) -> int | None:
    """The policy version of an SGLang `weight_version` label; None for SGLang's own
    labels ("default": the weights it was started with)."""
    text = str(label).strip()
    return int(text) if text.isdecimal() else None


@dataclass
class ReplicaAdapters:
    """The LoRA adapters one replica serves, as the gateway loaded them.

    `served`: adapter name -> the version this replica serves (its SGLang name is
    `<adapter>@v<version>`); `users`: SGLang adapter name -> requests of the gateway
    running on it there; `stale`: superseded SGLang names to unload once unused.
    """

    served: dict[str, int] = field(default_factory=dict)
    users: dict[str, int] = field(default_factory=dict)
    stale: set[str] = field(default_factory=set)
    loads_ok: int = 0
    loads_failed: int = 0
    unloads: int = 0
    unloads_failed: int = 0


@dataclass(eq=False)
class Replica:
    """One SGLang server as the gateway sees it."""

    url: str
    client: SGLangClient
    healthy: bool = False
    in_pool: bool = False
    version: int = 0
    state: str = "starting"  # starting | serving | updating | failed | down
    running: int = 0  # requests the gateway has open on it
    health_failures: int = 0
    requests: int = 0
    request_errors: int = 0
    updates_ok: int = 0
    updates_failed: int = 0
    pauses: int = 0  # times the gateway paused its generation (an abort then is ours)
    last_error: str = ""
    since: float = field(default_factory=time.time)
    loras: ReplicaAdapters = field(default_factory=ReplicaAdapters)

    def set_state(self, state: str, in_pool: bool) -> None:
        """Move to a state; `in_pool` says whether new requests may come here."""
        if state != self.state:
            self.since = time.time()
        self.state = state
        self.in_pool = in_pool and self.healthy

    def describe(self) -> dict[str, Any]:
        """JSON for /readyz and the admin view."""
        return {
            "url": self.url,
            "state": self.state,
            "healthy": self.healthy,
            "in_pool": self.in_pool,
            "version": self.version,
            "running": self.running,
            "updates_failed": self.updates_failed,
            "adapters": dict(self.loras.served),
            "last_error": self.last_error or None,
        }


class HashRing:
    """Consistent hashing of keys onto replicas (`VIRTUAL_NODES` points per replica)."""

    def __init__(self, replicas: list[Replica]) -> None:
        points = []
        for index, replica in enumerate(replicas):
            for v in range(VIRTUAL_NODES):
                points.append((_hash(f"{replica.url}#{v}"), index))
        points.sort()
        self._keys = [p[0] for p in points]
        self._owners = [p[1] for p in points]
        self._replicas = replicas

    def walk(self, key: str) -> Iterator[Replica]:
        """Every replica once, in ring order from the key's point."""
        start = bisect.bisect(self._keys, _hash(key))
        seen: set[int] = set()
        for i in range(len(self._owners)):
            owner = self._owners[(start + i) % len(self._owners)]
            if owner not in seen:
                seen.add(owner)
                yield self._replicas[owner]
            if len(seen) == len(self._replicas):
                return


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class ReplicaPool:
    """The replicas, their health loop, and request routing."""

    def __init__(
        self,
        urls: list[str],
        *,
        read_timeout_s: float,
        health_interval_s: float,
        health_timeout_s: float,
        health_failures: int,
    ) -> None:
        self.replicas = [Replica(url, SGLangClient(url, read_timeout_s)) for url in urls]
        self.ring = HashRing(self.replicas)
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.max_failures = health_failures
        self.on_recovered: Callable[[Replica], Awaitable[None]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._recovering: set[Replica] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def serving(self) -> list[Replica]:
        """Replicas taking new requests."""
        return [r for r in self.replicas if r.in_pool]

    def pick(
        self,
        affinity: str | None,
        exclude: set[Replica] | None = None,
        adapter: str | None = None,
    ) -> Replica | None:
        """The replica for a request: the session's on the ring, else the least busy
        (among those serving `adapter`, when one is named)."""
        candidates = [
            r
            for r in self.serving
            if (not exclude or r not in exclude) and (adapter is None or adapter in r.loras.served)
        ]
        if not candidates:
            return None
        if affinity is None:
            return min(candidates, key=lambda r: r.running)
        return next(r for r in self.ring.walk(affinity) if r in candidates)

    # ----------------------------------------------------------------- health
    async def start(self) -> None:
        """Start the background health checks."""
        if self._task is None:
            self._task = asyncio.create_task(self._health_loop(), name="sglang-health")

    async def stop(self) -> None:
        """Stop checking and close every client."""
        task, self._task = self._task, None
        for pending in [*([task] if task is not None else []), *self._tasks]:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending
        for replica in self.replicas:
            await replica.client.aclose()

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Take a replica out of the pool now (it failed a request or a check)."""
        if replica.healthy:
            log.warning("SGLang replica %s left the pool: %s", replica.url, reason)
        replica.healthy = False
        replica.last_error = reason
        replica.set_state("down", in_pool=False)

    async def check(self, replica: Replica) -> None:
        """One health check; hands a replica that answers again to `on_recovered`.

        Skipped while the replica loads weights: a big checkpoint can keep it from
        answering for longer than the failure budget, and the updater watches it then.
        """
        if replica.state == "updating":
            return
        try:
            await replica.client.health(self.health_timeout_s)
        except ReplicaUnavailable as exc:
            replica.health_failures += 1
            if exc.refused or replica.health_failures >= self.max_failures:
                self.mark_down(replica, str(exc))
            return
        replica.health_failures = 0
        if replica.healthy or replica in self._recovering:
            return
        replica.healthy = True
        if self.on_recovered is None:
            replica.set_state("serving", in_pool=True)
            return
        self._recovering.add(replica)
        task = asyncio.create_task(self._recover(replica), name=f"sglang-rejoin-{replica.url}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _recover(self, replica: Replica) -> None:
        """Off the health loop: the updater may need minutes to bring a replica up to date."""
        assert self.on_recovered is not None
        try:
            await self.on_recovered(replica)
        except Exception as exc:  # never let one replica stop the others
            log.exception("bringing SGLang replica %s back failed", replica.url)
            self.mark_down(replica, f"could not rejoin: {exc}")
        finally:
            self._recovering.discard(replica)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check_quietly(r) for r in self.replicas))
            await asyncio.sleep(self.health_interval_s)

    async def _check_quietly(self, replica: Replica) -> None:
        if replica in self._recovering:
            return
        try:
            await self.check(replica)
        except Exception:  # a bug in one check must not end health checking
            log.exception("health check of %s failed", replica.url)

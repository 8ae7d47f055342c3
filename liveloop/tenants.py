"""What the loops share about tenant scope: names, where a tenant's checkpoints live, lag.

In tenant scope (`trainer.scope = "tenant"`) each tenant (an API key id) has a LoRA adapter
of its own, named after it, trained only on its own judged turns. Version numbers stay
global (one counter for every tenant, so a version names one checkpoint and one registry
row), so how far a turn lags behind its tenant's adapter is not a difference of version
numbers but a count: how many of that tenant's versions were made after the oldest version
that produced the turn (`tenant_lag`). `TenantVersions` keeps that history per tenant as
the weight announcements tell it (the collector's view); the trainer keeps its own.
"""

from __future__ import annotations

import bisect
import hashlib
import re
from collections.abc import Iterable
from pathlib import Path

import redis.asyncio as aredis

from liveloop import bus
from liveloop.contracts import WeightsAnnouncement

TENANTS_SUBDIR = "tenants"
TENANT_MARK = "#tenant:"  # tenant scope: <tenant>#tenant:<name>, the tenant's own baseline

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def tenant_id(api_key: str | None) -> str:
    """The tenant of an API key: a stable, non-reversible id (never the key itself)."""
    if not api_key:
        return "anonymous"
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:12]


def of_tenant(tenant: str | None) -> str:
    """ " of tenant <id>" for log lines about a tenant's versions; "" outside tenant scope."""
    return f" of tenant {tenant}" if tenant else ""


def valid_tenant(tenant: str | None) -> bool:
    """Whether `tenant` can name an adapter and a directory (an API key id always can)."""
    return tenant is not None and NAME.match(tenant) is not None


def tenant_baseline_name(tenant: str | None, name: str) -> str:
    """The stored name of a baseline (a tenant's own, in tenant scope)."""
    return name if tenant is None else f"{tenant}{TENANT_MARK}{name}"


def split_tenant_baselines(
    state: dict[str, str],
) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """Stored baselines as (the shared ones, each tenant's own by tenant)."""
    shared: dict[str, str] = {}
    by_tenant: dict[str, dict[str, str]] = {}
    for name, value in state.items():
        tenant, mark, rest = name.partition(TENANT_MARK)
        if mark:
            by_tenant.setdefault(tenant, {})[rest] = value
        else:
            shared[name] = value
    return shared, by_tenant


def tenant_checkpoints(checkpoints_dir: Path, tenant: str) -> Path:
    """The directory holding one tenant's `v<N>` checkpoints."""
    if not valid_tenant(tenant):
        raise ValueError(f"not a tenant id: {tenant!r}")
    return Path(checkpoints_dir) / TENANTS_SUBDIR / tenant


def tenants_on_disk(checkpoints_dir: Path) -> list[str]:
    """Tenants that have a checkpoint directory, sorted."""
    root = Path(checkpoints_dir) / TENANTS_SUBDIR
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if d.is_dir() and valid_tenant(d.name))


def tenant_lag(oldest_version: int, tenant_versions: list[int]) -> int:
    """How many of a tenant's versions (sorted) came after `oldest_version`: the updates
    its adapter went through since the weights that produced a turn."""
    return len(tenant_versions) - bisect.bisect_right(tenant_versions, oldest_version)


class TenantVersions:
    """Each tenant's adapter versions, as announced on `liveloop:weights` (read incrementally).

    Every announced version counts, refused ones too: each is an update of the tenant's
    adapter, and staleness counts updates. Entries trimmed from the stream by retention
    before they were read are not counted.
    """

    def __init__(self, client: aredis.Redis) -> None:
        self.client = client
        self.by_tenant: dict[str, list[int]] = {}
        self.withdrawn: set[str] = set()  # tenants deleted since the last `take_withdrawn`
        self._last_id = "0-0"

    def add(self, announcements: Iterable[WeightsAnnouncement]) -> None:
        """Record announcements (in any order; repeats are ignored)."""
        for ann in announcements:
            if ann.tenant is None:
                continue
            if ann.withdrawn:  # the tenant was deleted: it starts over
                self.by_tenant.pop(ann.tenant, None)
                self.withdrawn.add(ann.tenant)
                continue
            versions = self.by_tenant.setdefault(ann.tenant, [])
            at = bisect.bisect_left(versions, ann.version)
            if at == len(versions) or versions[at] != ann.version:
                versions.insert(at, ann.version)

    async def refresh(self) -> None:
        """Read the announcements made since the last call."""
        stream = bus.stream_key(bus.WEIGHTS)
        while True:
            entries = await self.client.xrange(stream, min=f"({self._last_id}", count=500)
            if not entries:
                return
            last = entries[-1][0]
            self._last_id = last.decode() if isinstance(last, bytes) else str(last)
            self.add(bus.decode_entries(entries, WeightsAnnouncement))

    def take_withdrawn(self) -> set[str]:
        """Tenants whose deletion was announced since the last call."""
        taken, self.withdrawn = self.withdrawn, set()
        return taken

    def lag(self, tenant: str, oldest_version: int) -> int:
        """`tenant_lag` against what was read so far."""
        return tenant_lag(oldest_version, self.by_tenant.get(tenant, []))

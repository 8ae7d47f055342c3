"""Each version's quality on served traffic, exported as metrics and stored in the registry.

The judging loop and the trainer count per-version figures in Redis
(`liveloop.quality.QualityStore`); this reporter, run by the trainer, reads them every few
seconds, sets `liveloop_quality{version, measure}` for the newest versions, and stores
every version's measures in the registry's `version_quality` table, where `liveloop eval`
and the demo report find them. In tenant scope it also stores version 0's measures on each
trained tenant's own traffic (`liveloop eval --tenant` shows them beside its adapters).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import redis
from prometheus_client import CollectorRegistry, Gauge

from liveloop.quality import QualityStore, VersionQuality
from liveloop.registry import Registry, RegistryError

log = logging.getLogger(__name__)

EXPORTED_VERSIONS = 20  # label sets kept on /metrics (older versions stay in the registry)
MEASURES = ("mean_reward", "unscored_share", "mean_reply_words", "distinct_2", "ref_nll", "kl_ref")


class QualityReporter:
    """Mirrors the per-version quality counters to metrics and to the registry."""

    def __init__(
        self,
        store: QualityStore,
        registry: Registry,
        metrics: CollectorRegistry,
        tenants: Callable[[], Iterable[str]] = tuple,
    ) -> None:
        self.store = store
        self.registry = registry
        self.tenants = tenants  # whose base-served turns to store apart (tenant scope)
        self.gauge = Gauge(
            "liveloop_quality",
            "Quality of a policy version on the turns it served, by measure: mean judged "
            "reward, share of turns no judge could score, mean reply words, distinct-2, "
            "reference NLL per token, k3 KL to the reference.",
            ["version", "measure"],
            registry=metrics,
        )
        self.judged = Gauge(
            "liveloop_quality_turns",
            "Turns a policy version served that finished judging, by outcome.",
            ["version", "outcome"],
            registry=metrics,
        )
        self._exported: set[int] = set()
        self._stored: dict[int, VersionQuality] = {}
        self._stored_bases: dict[str, VersionQuality] = {}

    async def run(self, interval_s: float) -> None:
        """Report every `interval_s` until cancelled; errors are logged, never fatal."""
        while True:
            await self.report()
            await asyncio.sleep(interval_s)

    async def report(self) -> None:
        """One round: read every version's counters, export the newest, store the changed."""
        try:
            found = await self.store.read()
        except (redis.RedisError, OSError) as exc:
            log.warning("cannot read quality counters: %s", exc)
            return
        self._export(found[-EXPORTED_VERSIONS:])
        changed = [q for q in found if self._stored.get(q.version) != q]
        try:
            for quality in changed:
                await asyncio.to_thread(
                    self.registry.record_version_quality,
                    quality.version,
                    served=quality.model_dump(),
                )
                self._stored[quality.version] = quality
            await self._store_tenant_bases()
        except RegistryError as exc:
            log.warning("cannot store version quality: %s", exc)
        except (redis.RedisError, OSError) as exc:
            log.warning("cannot read quality counters: %s", exc)

    async def _store_tenant_bases(self) -> None:
        """Version 0's measures on each tenant's own turns, where they changed."""
        for tenant in list(self.tenants()):
            [base] = await self.store.read([0], tenant=tenant)
            if base.judged + base.unscored + base.ref_tokens == 0 or (
                self._stored_bases.get(tenant) == base
            ):
                continue
            await asyncio.to_thread(
                self.registry.record_version_quality, 0, served=base.model_dump(), tenant=tenant
            )
            self._stored_bases[tenant] = base

    def _export(self, newest: list[VersionQuality]) -> None:
        keep = {q.version for q in newest}
        for version in self._exported - keep:
            for measure in MEASURES:
                self.gauge.remove(str(version), measure)
            for outcome in ("judged", "unscored"):
                self.judged.remove(str(version), outcome)
        for quality in newest:
            label = str(quality.version)
            for measure in MEASURES:
                value = getattr(quality, measure)
                if value is not None:
                    self.gauge.labels(label, measure).set(value)
            self.judged.labels(label, "judged").set(quality.judged)
            self.judged.labels(label, "unscored").set(quality.unscored)
        self._exported = keep

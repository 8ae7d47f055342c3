"""Per-tenant training metrics of tenant scope, under bounded labels.

Operators need to see which tenant's adapter learns, which one keeps being refused or rolled
back. A label per tenant would grow a series per tenant forever, so the busiest tenants by
samples trained are named (`liveloop.labels.TopLabels`) and the rest are counted as
`other`; a tenant that drops out of the named set has its series removed. Gauges (version,
reward) are kept only for named tenants (an `other` version means nothing).
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge

from liveloop.labels import OTHER, TopLabels

TENANT_LABELS = 20


class TenantMetrics:
    """Versions, reward, updates, refusals and rollbacks per tenant (bounded labels)."""

    def __init__(self, registry: CollectorRegistry, limit: int = TENANT_LABELS) -> None:
        self.version = Gauge(
            "liveloop_tenant_version",
            f"Version of each tenant's adapter now (the {limit} busiest tenants).",
            ["tenant"],
            registry=registry,
        )
        self.reward = Gauge(
            "liveloop_tenant_reward",
            f"Mean judged reward of each tenant's last trained batch (the {limit} busiest).",
            ["tenant"],
            registry=registry,
        )
        self.updates = self._counter(registry, "updates", "Updates of each tenant's adapter")
        self.samples = self._counter(registry, "samples", "Samples trained per tenant")
        self.refusals = self._counter(
            registry, "refusals", "Versions of each tenant's adapter the promotion gate refused"
        )
        self.rollbacks = self._counter(
            registry, "rollbacks", "Rollbacks of each tenant's adapter by the served-quality watch"
        )
        self.labels = TopLabels(limit, self._drop)

    @staticmethod
    def _counter(registry: CollectorRegistry, name: str, doc: str) -> Counter:
        return Counter(
            f"liveloop_tenant_{name}",
            f"{doc} (the busiest tenants by name, the rest as 'other').",
            ["tenant"],
            registry=registry,
        )

    def _drop(self, tenant: str) -> None:
        for metric in (self.version, self.reward, self.updates, self.samples, self.refusals,
                       self.rollbacks):  # fmt: skip
            with contextlib.suppress(KeyError):
                metric.remove(tenant)

    def trained(
        self, tenant: str, version: int, reward: float, samples: int, *, refused: bool
    ) -> None:
        """One update of `tenant`'s adapter, now at `version` (a refused one: not moved)."""
        label = self.labels.label(tenant, samples)
        for counter in (self.refusals, self.rollbacks):  # from 0, so `increase` sees the first
            counter.labels(label)
        self.updates.labels(label).inc()
        self.samples.labels(label).inc(samples)
        if refused:
            self.refusals.labels(label).inc()
        if label != OTHER:
            self.version.labels(label).set(version)
            self.reward.labels(label).set(reward)

    def rolled_back(self, tenant: str, version: int) -> None:
        """`tenant`'s adapter was rolled back (the target's weights live again as `version`)."""
        label = self.labels.label(tenant, 0)
        self.rollbacks.labels(label).inc()
        if label != OTHER:
            self.version.labels(label).set(version)

    def forget(self, tenant: str) -> None:
        """A deleted tenant's series."""
        self.labels.named.discard(tenant)
        self.labels.counts.pop(tenant, None)
        self._drop(tenant)

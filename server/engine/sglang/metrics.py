"""Per-replica Prometheus metrics of the SGLang gateway, read from the pool on each scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from liveloop.server.engine.sglang.pool import Replica, ReplicaPool


class ReplicaCollector(Collector):
    """`liveloop_sglang_replica_*{replica="URL"}`: up, in pool, running, version, adapters,
    counters."""

    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        """One sample per replica and metric."""
        gauges: dict[str, tuple[str, Callable[[Replica], float]]] = {
            "up": ("1 while the replica answers its health checks.", lambda r: r.healthy),
            "in_pool": ("1 while the replica takes new requests.", lambda r: r.in_pool),
            "running_requests": (
                "Requests the gateway has open on the replica.",
                lambda r: r.running,
            ),
            "policy_version": ("Policy version the replica serves.", lambda r: r.version),
            "adapters": ("LoRA adapters the replica serves.", lambda r: len(r.loras.served)),
        }
        for name, (doc, read) in gauges.items():
            family = GaugeMetricFamily(f"liveloop_sglang_replica_{name}", doc, labels=["replica"])
            for replica in self.pool.replicas:
                family.add_metric([replica.url], float(read(replica)))
            yield family
        requests = CounterMetricFamily(
            "liveloop_sglang_replica_requests",
            "Generation requests sent to the replica, by outcome (ok, error).",
            labels=["replica", "outcome"],
        )
        updates = CounterMetricFamily(
            "liveloop_sglang_replica_weight_updates",
            "Weight updates of the replica, by outcome (ok, failed).",
            labels=["replica", "outcome"],
        )
        adapter_loads = CounterMetricFamily(
            "liveloop_sglang_replica_adapter_loads",
            "LoRA adapter versions loaded into the replica, by outcome (ok, failed; a failed "
            "one is retried, the previous version serving meanwhile).",
            labels=["replica", "outcome"],
        )
        for replica in self.pool.replicas:
            requests.add_metric([replica.url, "ok"], replica.requests - replica.request_errors)
            requests.add_metric([replica.url, "error"], replica.request_errors)
            updates.add_metric([replica.url, "ok"], replica.updates_ok)
            updates.add_metric([replica.url, "failed"], replica.updates_failed)
            adapter_loads.add_metric([replica.url, "ok"], replica.loras.loads_ok)
            adapter_loads.add_metric([replica.url, "failed"], replica.loras.loads_failed)
        yield requests
        yield updates
        yield adapter_loads

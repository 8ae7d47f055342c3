"""Entry point of `liveloop collect`: connect, serve metrics, run the collecting loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading

from prometheus_client import CollectorRegistry

from liveloop import bus
from liveloop.bus.retention import start_retention
from liveloop.collector.loop import Collector
from liveloop.collector.metrics import CollectorMetrics
from liveloop.collector.versions import TrainerVersion
from liveloop.config import CollectorConfig, RetentionSettings, SharedSettings
from liveloop.health import LoopHealth
from liveloop.registry import Registry
from liveloop.streamstats import StreamStateCollector

log = logging.getLogger(__name__)


class RegistryVersion:
    """Newest version recorded in the registry (used when `liveloop:weights` is empty)."""

    def __init__(self, db_url: str) -> None:
        self.db_url = db_url
        self._registry: Registry | None = None

    def __call__(self) -> int | None:
        if self._registry is None:
            self._registry = Registry.open(self.db_url)
        latest = self._registry.latest_model_version()
        return latest.version if latest is not None else None

    def close(self) -> None:
        """Release the registry's connections."""
        if self._registry is not None:
            self._registry.close()


async def serve(
    shared: SharedSettings,
    cfg: CollectorConfig,
    metrics: CollectorMetrics,
    retention: RetentionSettings | None = None,
    *,
    tenant_scope: bool = False,
) -> None:
    """Run the collector (and stream retention, when given and enabled) until SIGINT/SIGTERM."""
    client = await bus.connect(shared.require_redis("collect"))
    registry_version = RegistryVersion(shared.effective_db_url)
    versions = TrainerVersion(client, poll_s=cfg.version_poll_s, registry_latest=registry_version)
    collector = Collector(
        shared, cfg, client, metrics=metrics, trainer_version=versions, tenant_scope=tenant_scope
    )
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    # Signals reach only the main thread; embedded in another program's thread, skip them.
    handle = threading.current_thread() is threading.main_thread()
    for sig in signals if handle else ():
        loop.add_signal_handler(sig, collector.stop)
    # Retention runs here: one light background task (a pass a minute, under a Redis lock
    # so that several collectors never trim at once), away from serving and judging.
    background = None
    if retention is not None:
        background = start_retention(client, retention, shared.data_dir, metrics.registry)
    try:
        await collector.run()
    finally:
        if background is not None:
            background.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await background
        for sig in signals if handle else ():
            loop.remove_signal_handler(sig)
        registry_version.close()
        await client.aclose()


def run(
    shared: SharedSettings,
    cfg: CollectorConfig,
    retention: RetentionSettings | None = None,
    *,
    tenant_scope: bool = False,
) -> None:
    """Collect (and archive and trim the streams, see `liveloop.bus.retention`) until stopped
    (`tenant_scope`: batches of one tenant's turns each, `trainer.scope = "tenant"`)."""
    metrics = CollectorMetrics(CollectorRegistry())
    health = LoopHealth(metrics.registry, shared.redis_url)
    if shared.metrics_port is not None:
        if shared.redis_url:  # the bus's own state (lag, pending, dead letters) rides along
            metrics.registry.register(StreamStateCollector(shared.redis_url))
        health.start(shared.metrics_port, shared.host)
    try:
        health.mark_ready()
        asyncio.run(serve(shared, cfg, metrics, retention, tenant_scope=tenant_scope))
    finally:
        health.stop()

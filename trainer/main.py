"""Entry point of `liveloop train`: join the process group, serve metrics, run the loop.

Runs as one process, or under `accelerate launch --num_processes N` (every rank runs this;
rank 0 does the I/O and the others follow its broadcasts).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry

from liveloop.config import JudgeConfig, SharedSettings, TrainerConfig
from liveloop.health import LoopHealth
from liveloop.trainer.dist import Comm
from liveloop.trainer.loop import Trainer
from liveloop.trainer.metrics import TrainerMetrics

log = logging.getLogger(__name__)


@contextmanager
def stop_on_signals(stop: Callable[[], None]) -> Iterator[None]:
    """SIGINT/SIGTERM call `stop` (a clean finish after the current update) while inside.

    Outside the main thread (a loop embedded in another program) signals are left alone.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, lambda *_: stop())
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(shared: SharedSettings, cfg: TrainerConfig, judging: JudgeConfig) -> None:
    """Train until stopped (or `trainer.max_updates`), publishing a version per batch.

    `judging` (the judges and their settings) is what the promotion gate judges probes with.
    """
    comm = Comm.from_environment(cfg.device)
    metrics = TrainerMetrics(CollectorRegistry())
    health = LoopHealth(metrics.registry, shared.redis_url)
    if comm.is_main and shared.metrics_port is not None:
        health.start(shared.metrics_port, shared.host)
    kind = Trainer
    if cfg.tenant_scope:  # one adapter per tenant (trainer.scope)
        from liveloop.trainer.tenants import TenantTrainer

        kind = TenantTrainer
    trainer = kind(shared, cfg, judging=judging, metrics=metrics, comm=comm)
    try:
        health.mark_ready()
        with stop_on_signals(trainer.stop):
            if comm.is_main:
                asyncio.run(trainer.run())
            else:
                trainer.follow()
    finally:
        health.stop()
        comm.close()

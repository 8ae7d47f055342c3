"""`liveloop judge`: run the judging loop, or replay history with other judges and exit.

Start-up checks the configured judges first (an unknown name stops here with the list of
available judges), then connects to Redis, serves Prometheus metrics when a metrics port
is set, and runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from liveloop import bus
from liveloop.bus.archive import Archive
from liveloop.config import ConfigError, JudgeConfig, SharedSettings
from liveloop.health import LoopHealth
from liveloop.prm.judges.registry import load_judges
from liveloop.prm.metrics import PrmMetrics
from liveloop.prm.panel import JudgePanel
from liveloop.prm.replay import Replayer, ReplayStats
from liveloop.prm.service import JudgeService

log = logging.getLogger(__name__)

PROTECTED_STREAMS = bus.STREAMS


@dataclass
class ReplayOptions:
    """`--replay`: which judges re-score turns from which stream id, into which stream; with
    `archive`, the turns retention archived there are read first."""

    judges: list[str]
    from_id: str = "-"
    to_stream: str = "replay"
    archive: Path | None = None


def _check_replay(options: ReplayOptions) -> None:
    if not options.judges:
        raise ConfigError("--replay needs at least one --judge NAME")
    target = bus.stream_key(options.to_stream)
    if target in {bus.stream_key(s) for s in PROTECTED_STREAMS}:
        raise ConfigError(f"--to-stream must be a separate stream, not {target}")
    if options.archive is not None and not options.archive.is_dir():
        raise ConfigError(f"--archive {options.archive} is not a directory")


def run(
    shared: SharedSettings, judging: JudgeConfig, *, replay: ReplayOptions | None = None
) -> None:
    """Run the judging loop until a signal, or one replay (then return)."""
    redis_url = shared.require_redis("judge")
    if replay is not None:
        _check_replay(replay)
        weights = {name: 1.0 for name in replay.judges}
    else:
        weights = dict(judging.judges)
    judges = load_judges(weights, judging, shared)
    registry = CollectorRegistry()
    metrics = PrmMetrics(registry)
    health = LoopHealth(registry, redis_url)
    if shared.metrics_port is not None:
        health.start(shared.metrics_port, shared.host)
    panel = JudgePanel(
        judges, metrics, timeout_s=judging.judge_timeout_s, hint_chars=judging.hint_chars
    )
    try:
        if replay is not None:
            stats = asyncio.run(_replay(redis_url, panel, replay))
            summary = asdict(stats)
            summary["errors"] = summary["errors"][:5]
            print(json.dumps({"replay": summary, "to_stream": bus.stream_key(replay.to_stream)}))
        else:
            health.mark_ready()
            asyncio.run(_serve(redis_url, judging, panel, metrics))
    finally:
        health.stop()


async def _close_judges(panel: JudgePanel) -> None:
    for judge, _ in panel.judges:
        try:
            await judge.aclose()
        except Exception:
            log.exception("closing judge %s failed", judge.name)


async def _replay(url: str, panel: JudgePanel, options: ReplayOptions) -> ReplayStats:
    client = await bus.connect(url)
    try:
        archive = Archive(options.archive) if options.archive is not None else None
        replayer = Replayer(client, panel, options.to_stream, archive=archive)
        return await replayer.run(options.from_id)
    finally:
        await _close_judges(panel)
        await client.aclose()


async def _serve(
    redis_url: str, judging: JudgeConfig, panel: JudgePanel, metrics: PrmMetrics
) -> None:
    client = await bus.connect(redis_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    service = JudgeService(client, judging, panel, metrics)
    log.info(
        "judging %s as consumer %s with %s",
        bus.stream_key(bus.TURNS),
        service.turns.consumer,
        ", ".join(f"{n}×{w:g}" for n, w in judging.judges.items()),
    )
    try:
        await service.run(stop)
    finally:
        await _close_judges(panel)
        await client.aclose()

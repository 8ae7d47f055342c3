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

from prometheus_client import CollectorRegistry, start_http_server

from liveloop import bus
from liveloop.config import ConfigError, LiveLoopSettings
from liveloop.prm.judges.registry import load_judges
from liveloop.prm.metrics import PrmMetrics
from liveloop.prm.panel import JudgePanel
from liveloop.prm.replay import Replayer, ReplayStats
from liveloop.prm.service import JudgeService

log = logging.getLogger(__name__)

PROTECTED_STREAMS = bus.STREAMS


@dataclass
class ReplayOptions:
    """`--replay`: which judges re-score turns from which stream id, into which stream."""

    judges: list[str]
    from_id: str = "-"
    to_stream: str = "replay"


def _check_replay(options: ReplayOptions) -> None:
    if not options.judges:
        raise ConfigError("--replay needs at least one --judge NAME")
    target = bus.stream_key(options.to_stream)
    if target in {bus.stream_key(s) for s in PROTECTED_STREAMS}:
        raise ConfigError(f"--to-stream must be a separate stream, not {target}")


def run(settings: LiveLoopSettings, *, replay: ReplayOptions | None = None) -> None:
    """Run the judging loop until a signal, or one replay (then return)."""
    if not settings.redis_url:
        raise ConfigError("liveloop judge needs --redis-url (or LIVELOOP_REDIS_URL)")
    if replay is not None:
        _check_replay(replay)
        weights = {name: 1.0 for name in replay.judges}
    else:
        weights = dict(settings.prm.judges)
    judges = load_judges(weights, settings)
    registry = CollectorRegistry()
    metrics = PrmMetrics(registry)
    if settings.metrics_port is not None:
        start_http_server(settings.metrics_port, registry=registry)
    panel = JudgePanel(
        judges,
        metrics,
        timeout_s=settings.prm.judge_timeout_s,
        hint_chars=settings.prm.hint_chars,
    )
    if replay is not None:
        stats = asyncio.run(_replay(settings.redis_url, panel, replay))
        summary = asdict(stats)
        summary["errors"] = summary["errors"][:5]
        print(json.dumps({"replay": summary, "to_stream": bus.stream_key(replay.to_stream)}))
    else:
        asyncio.run(_serve(settings, panel, metrics))


async def _close_judges(panel: JudgePanel) -> None:
    for judge, _ in panel.judges:
        close = getattr(judge, "aclose", None)
        if close is not None:
            try:
                await close()
            except Exception:
                log.exception("closing judge %s failed", judge.name)


async def _replay(url: str, panel: JudgePanel, options: ReplayOptions) -> ReplayStats:
    client = await bus.connect(url)
    try:
        return await Replayer(client, panel, options.to_stream).run(options.from_id)
    finally:
        await _close_judges(panel)
        await client.aclose()


async def _serve(settings: LiveLoopSettings, panel: JudgePanel, metrics: PrmMetrics) -> None:
    assert settings.redis_url is not None
    client = await bus.connect(settings.redis_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    service = JudgeService(client, settings.prm, panel, metrics)
    log.info(
        "judging %s as consumer %s with %s",
        bus.stream_key(bus.TURNS),
        service.turns.consumer,
        ", ".join(f"{n}×{w:g}" for n, w in settings.prm.judges.items()),
    )
    try:
        await service.run(stop)
    finally:
        await _close_judges(panel)
        await client.aclose()

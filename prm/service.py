"""The judging loop of one process: intake, deadline sweeper, scorer and lag monitor.

Any number of processes may run it against the same Redis: they share the consumer group
`prm` on `liveloop:turns`, `liveloop:feedback` and the internal ready stream, and every
pairing decision is an atomic script, so the work is split and no turn is scored twice.
Each part runs as its own task; a Redis hiccup or a bug in one batch is logged and the
loop goes on after a short pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aredis

from liveloop import bus
from liveloop.bus import Entry, StreamConsumer, keys
from liveloop.config.prm import JudgeConfig
from liveloop.prm.intake import FeedbackIntake, TurnIntake
from liveloop.prm.metrics import PrmMetrics
from liveloop.prm.pairing import PairingStore
from liveloop.prm.panel import JudgePanel
from liveloop.prm.scorer import Scorer

log = logging.getLogger(__name__)

BLOCK_MS = 250


class JudgeService:
    """Everything `liveloop judge` runs, for one process; `run(stop)` until stop is set."""

    def __init__(
        self,
        client: aredis.Redis,
        config: JudgeConfig,
        panel: JudgePanel,
        metrics: PrmMetrics,
        consumer_name: str | None = None,
    ) -> None:
        self.client = client
        self.config = config
        self.panel = panel
        self.metrics = metrics
        name = consumer_name or config.consumer.name or bus.default_consumer_name()
        self.store = PairingStore(
            client,
            timeout_s=config.next_state_timeout_s,
            ttl_s=config.state_ttl_s,
            arrival_ttl_s=config.arrival_ttl_s,
        )
        self.turns = self._consumer(bus.TURNS, name)
        self.feedback = self._consumer(bus.FEEDBACK, name)
        self.ready = self._consumer(
            keys.PRM_READY, name, dlq=bus.dlq_key(bus.TURNS), delete_acked=True
        )
        if not panel.inline:
            self.ready.count = config.slow_read_count
        self.turn_intake = TurnIntake(self.turns, self.store, metrics)
        self.feedback_intake = FeedbackIntake(self.feedback, self.store, metrics)
        self.scorer = Scorer(self.ready, self.store, panel, metrics)
        self._batches: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()

    def _consumer(
        self, stream: str, name: str, dlq: str | None = None, delete_acked: bool = False
    ) -> StreamConsumer:
        return StreamConsumer(
            self.client,
            stream,
            keys.PRM_GROUP,
            name,
            claim_idle_ms=self.config.consumer.claim_idle_ms,
            max_attempts=self.config.max_attempts,
            count=self.config.consumer.read_count,
            dead_letter_stream=dlq,
            backoff_max_s=self.config.retry_backoff_max_s,
            delete_acked=delete_acked,
        )

    async def setup(self) -> None:
        """Create the consumer groups (and streams) if missing."""
        for consumer in (self.turns, self.feedback, self.ready):
            await consumer.ensure_group("0")

    async def run(self, stop: asyncio.Event) -> None:
        """Run every part until `stop` is set, then let batches in flight finish."""
        self._stop = stop
        await self.setup()
        loops = [
            self._forever(stop, "turn intake", lambda: self.turn_intake.step(BLOCK_MS)),
            self._forever(stop, "feedback intake", lambda: self.feedback_intake.step(BLOCK_MS)),
            self._forever(stop, "sweeper", self._sweep_once),
            self._forever(stop, "scorer", self._score_once),
            self._forever(stop, "lag monitor", self._measure_once),
            self._forever(stop, "keep-alive", self._keep_alive_once),
        ]
        await asyncio.gather(*loops)
        if self._batches:
            await asyncio.wait(self._batches, timeout=self.config.judge_timeout_s)

    async def _forever(
        self, stop: asyncio.Event, what: str, step: Callable[[], Awaitable[object]]
    ) -> None:
        pause = 0.5
        while not stop.is_set():
            try:
                await step()
                pause = 0.5
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s failed; retrying in %.1fs", what, pause)
                await self._nap(pause)
                pause = min(pause * 2, 10.0)

    async def _nap(self, seconds: float) -> None:
        """Sleep, but wake up at once when the service is stopped."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _sweep_once(self) -> None:
        while await self.store.sweep(1000) == 1000:
            pass
        await self._nap(self.config.sweep_interval_s)

    async def _measure_once(self) -> None:
        for consumer in (self.turns, self.feedback, self.ready):
            lag, pending = await consumer.lag()
            self.metrics.lag.labels(consumer.stream).set(lag)
            self.metrics.pending.labels(consumer.stream).set(pending)
        self.metrics.waiting.set(await self.store.waiting_count())
        await self._nap(self.config.lag_interval_s)

    async def _keep_alive_once(self) -> None:
        await self.ready.keep_alive()
        await self._nap(self.config.consumer.claim_idle_ms / 3000)

    async def _score_once(self) -> None:
        """Start one batch of ready jobs, keeping at most `max_inflight_batches` running."""
        while len(self._batches) >= self.config.max_inflight_batches:
            await asyncio.wait(self._batches, return_when=asyncio.FIRST_COMPLETED)
        entries = await self.ready.read(BLOCK_MS)
        if not entries:
            return
        ids = {e.id for e in entries}
        self.ready.in_flight |= ids
        task = asyncio.create_task(self._score_batch(entries, ids))
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    async def _score_batch(self, entries: list[Entry], ids: set[str]) -> None:
        try:
            await self.scorer.process(entries)
        except Exception:
            log.exception("scoring a batch of %d jobs failed; they will be retried", len(entries))
        finally:
            self.ready.in_flight -= ids

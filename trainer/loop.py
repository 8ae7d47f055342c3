"""The training loop: batches in, policy versions out, never waiting on the server.

`Trainer.run()` (rank 0) reads one batch, drops samples that are invalid or too stale for
the current version, runs one update (`PPOUpdater`), writes checkpoint `v<N+1>`, records it
in the registry, announces it on `liveloop:weights`, prunes old checkpoints, and only then
acknowledges the batch. With several ranks, rank 0 broadcasts every step's message
(a batch, idle, or stop) and the others run `follow()`. After a restart the trainer resumes
from its newest checkpoint: weights, optimizer state, version, and the batch ids it has
applied, so a re-delivered batch is acknowledged without being trained twice.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from liveloop import bus
from liveloop.config import LiveLoopSettings
from liveloop.contracts import BatchSample
from liveloop.registry import Registry
from liveloop.trainer.checkpoints import CheckpointStore, TrainerState
from liveloop.trainer.data import validate_sample
from liveloop.trainer.dist import Comm
from liveloop.trainer.metrics import TrainerMetrics
from liveloop.trainer.policy import load_policy
from liveloop.trainer.ppo import PPOUpdater, UpdateStats
from liveloop.trainer.source import BatchSource, Publisher, ReceivedBatch

log = logging.getLogger(__name__)


@dataclass
class StepMessage:
    """What rank 0 tells every rank to do next."""

    kind: str  # "batch", "idle" or "stop"
    samples: list[BatchSample] = field(default_factory=list)


class Trainer:
    """Consumes `liveloop:batches`, trains, and publishes a new policy version per batch."""

    def __init__(
        self,
        settings: LiveLoopSettings,
        *,
        metrics: TrainerMetrics | None = None,
        comm: Comm | None = None,
    ) -> None:
        self.settings = settings
        self.cfg = settings.trainer
        self.metrics = metrics or TrainerMetrics()
        self.comm = comm or Comm()
        self.store = CheckpointStore(settings.checkpoints_dir, self.cfg.keep_checkpoints)
        self.state = TrainerState(version=0, parent=None)
        self.updater: PPOUpdater | None = None
        self.updates_done = 0
        self.last_stats: UpdateStats | None = None
        self._stop = threading.Event()

    @property
    def version(self) -> int:
        """The policy version of the weights held now (0 = the initial model)."""
        return self.state.version

    def stop(self) -> None:
        """Ask the loop to finish after the update in progress (thread- and signal-safe)."""
        self._stop.set()

    # -- set-up (every rank) -------------------------------------------------------------

    def setup(self) -> None:
        """Load the policy from the newest checkpoint (or the base model) and its optimizer."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no per-checkpoint progress bars in the logs
        latest = self.comm.broadcast(self.store.latest() if self.comm.is_main else None)
        checkpoint = self.store.path_for(latest) if latest is not None else None
        policy = load_policy(
            self.settings.model,
            self.cfg.device,
            self.cfg.lora,
            checkpoint=checkpoint,
            with_reference=self.cfg.kl_coef > 0,
        )
        self.updater = PPOUpdater(policy, self.cfg, self.comm)
        if latest is not None:
            self.store.load_optimizer(latest, self.updater.optimizer)
            self.state = self.store.load_state(latest)
            log.info("resumed from checkpoint v%d", latest)

    def _updater(self) -> PPOUpdater:
        if self.updater is None:
            raise RuntimeError("Trainer.setup() has not run")
        return self.updater

    # -- followers (ranks > 0) -----------------------------------------------------------

    def follow(self) -> None:
        """Loop of a rank > 0: do what rank 0 broadcasts until it says stop."""
        self.setup()
        while True:
            message: StepMessage = self.comm.broadcast(None)
            if message.kind == "stop":
                return
            if message.kind == "batch":
                self._updater().update(message.samples)

    # -- rank 0 ------------------------------------------------------------------------

    async def run(self) -> None:
        """Loop of rank 0 until `stop()` or `max_updates`."""
        await asyncio.to_thread(self.setup)
        try:
            await self._serve()
        except BaseException:
            if self.comm.world > 1:  # release the followers waiting for a message
                await asyncio.to_thread(self.comm.broadcast, StepMessage("stop"))
            raise

    async def _serve(self) -> None:
        client = await bus.connect(self._redis_url())
        registry = await asyncio.to_thread(Registry.open, self.settings.effective_db_url)
        run_id = await asyncio.to_thread(registry.start_run, "train", self._run_config())
        publisher = Publisher(client, registry, run_id)
        source = BatchSource(
            client,
            self.settings.data_dir,
            consumer=self.cfg.consumer_name,
            claim_idle_ms=self.cfg.claim_idle_ms,
        )
        status = "failed"
        try:
            await source.start()
            await self._reconcile(publisher)
            await self._lead(source, publisher)
            status = "finished"
        finally:
            await asyncio.to_thread(registry.finish_run, run_id, status)
            registry.close()
            await client.aclose()

    def _redis_url(self) -> str:
        if not self.settings.redis_url:
            raise bus.BusUnavailable("liveloop train needs --redis-url (or LIVELOOP_REDIS_URL)")
        return self.settings.redis_url

    def _run_config(self) -> dict[str, object]:
        return {"model": self.settings.model, "world": self.comm.world, **self.cfg.model_dump()}

    async def _reconcile(self, publisher: Publisher) -> None:
        """Make sure the checkpoint we resumed from is recorded and announced."""
        if self.version == 0:
            return
        path = self.store.path_for(self.version)
        await asyncio.to_thread(
            publisher.record, self.version, path, self.state.parent, self.state.metrics
        )
        await publisher.announce(self.version, path, self.state.parent, self.state.metrics)

    async def _lead(self, source: BatchSource, publisher: Publisher) -> None:
        while True:
            item, message = await self._next_message(source)
            if self.comm.world > 1:
                await asyncio.to_thread(self.comm.broadcast, message)
            if message.kind == "stop":
                return
            if item is not None:
                await self._apply(item, message.samples, source, publisher)

    def _finished(self) -> bool:
        limit = self.cfg.max_updates
        return self._stop.is_set() or (limit is not None and self.updates_done >= limit)

    async def _next_message(self, source: BatchSource) -> tuple[ReceivedBatch | None, StepMessage]:
        if self._finished():
            return None, StepMessage("stop")
        item = await source.next(self.cfg.read_block_ms)
        if item is None:
            return None, StepMessage("idle")
        if item.batch.batch_id in self.state.applied_batches:
            log.info("batch %s was applied before a restart; acknowledging", item.batch.batch_id)
            self.metrics.dropped.labels("duplicate_batch").inc(len(item.samples))
            await source.done(item)
            return None, StepMessage("idle")
        samples = self._trainable(item.samples)
        if not samples:
            await source.done(item)
            return None, StepMessage("idle")
        return item, StepMessage("batch", samples)

    def _trainable(self, samples: list[BatchSample]) -> list[BatchSample]:
        """Valid samples within the staleness bound of the current version."""
        bound = self.settings.collector.max_staleness
        kept = []
        for sample in samples:
            problem = validate_sample(sample)
            if problem is not None:
                log.warning("dropping sample %s: %s", sample.key, problem)
                self.metrics.dropped.labels("invalid").inc()
                continue
            lag = self.version - min(sample.versions, default=self.version)
            if lag > bound:
                self.metrics.dropped.labels("stale").inc()
                continue
            self.metrics.staleness.observe(max(lag, 0))
            kept.append(sample)
        return kept

    async def _apply(
        self,
        item: ReceivedBatch,
        samples: list[BatchSample],
        source: BatchSource,
        publisher: Publisher,
    ) -> None:
        self.metrics.batch_wait.observe(max(time.time() - item.batch.created_at, 0.0))
        stats = await asyncio.to_thread(self._updater().update, samples)
        started = time.perf_counter()
        metrics = stats.as_metrics()
        metrics["reward_mean"] = sum(s.score for s in samples) / len(samples)
        state = TrainerState(
            version=self.version + 1,
            parent=self.version,
            applied_batches=[*self.state.applied_batches, item.batch.batch_id],
            metrics=metrics,
        )
        path = await asyncio.to_thread(self._save, state)
        await asyncio.to_thread(publisher.record, state.version, path, state.parent, metrics)
        await publisher.announce(state.version, path, state.parent, metrics)
        pruned = await asyncio.to_thread(self.store.prune)
        await asyncio.to_thread(publisher.forget, pruned)
        await source.done(item)
        self.state = state
        self.updates_done += 1
        self.last_stats = stats
        self.metrics.publish_seconds.set(time.perf_counter() - started)
        self.metrics.observe_update(stats, state.version)
        log.info(
            "v%d: %d samples, loss %.4f, %.0f tok/s, kl %.2e",
            state.version,
            stats.samples,
            stats.loss,
            stats.tokens_per_s,
            stats.approx_kl,
        )

    def _save(self, state: TrainerState) -> Path:
        updater = self._updater()
        policy = updater.policy
        adapter = policy.model if policy.lora else None
        return self.store.save(
            policy.export(), policy.tokenizer, updater.optimizer, state, adapter=adapter
        )

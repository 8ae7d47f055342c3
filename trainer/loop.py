"""The training loop: batches in, policy versions out, never waiting on the server.

`Trainer.run()` (rank 0) reads one batch, drops samples that are invalid or too stale for
the current version, runs one update (`PPOUpdater`), lets the promotion gate probe the new
weights (`liveloop.trainer.gate`), writes checkpoint `v<N>`, records it in the registry as
accepted or rejected, announces it on `liveloop:weights`, prunes old checkpoints, and only
then acknowledges the batch. After a rejection the trainer goes back to the last accepted
version's weights and optimizer state (or, if so configured, trains on from the rejected
ones); version numbers are never reused. With several ranks, rank 0 broadcasts every step's
message (a batch, a revert, idle, or stop) and the others run `follow()`. After a restart
the trainer resumes from its newest accepted checkpoint: weights, optimizer state, version,
and the batch ids it has applied, so a re-delivered batch is not trained twice. Alongside,
it exports each version's quality on served traffic (`liveloop.trainer.reporting`), and
between updates its served-quality watch (`liveloop.trainer.watch`) compares the live
versions' served reward and, after a clear fall, publishes the last good weights again.
The gate and the watch, with their counters, live in `liveloop.trainer.guards`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aredis

from liveloop import bus
from liveloop.config import JudgeConfig, SharedSettings, TrainerConfig
from liveloop.config.defaults import model_defaults
from liveloop.contracts import BatchSample
from liveloop.quality import QualityStore
from liveloop.registry import Registry
from liveloop.trainer.checkpoints import CheckpointStore, TrainerState
from liveloop.trainer.dist import Comm
from liveloop.trainer.guards import Safeguards
from liveloop.trainer.metrics import TrainerMetrics
from liveloop.trainer.policy import load_policy
from liveloop.trainer.ppo import PPOUpdater, UpdateStats
from liveloop.trainer.reporting import QualityReporter
from liveloop.trainer.source import BatchSource, Publisher, ReceivedBatch, trainable_samples
from liveloop.trainer.watch import Rollback
from liveloop.weights import setup_weight_transport

log = logging.getLogger(__name__)

RETRY_INITIAL_S = 1.0
RETRY_MAX_S = 15.0
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


@dataclass
class StepMessage:
    """What rank 0 tells every rank to do next."""

    kind: str  # "batch", "revert", "idle" or "stop"
    samples: list[BatchSample] = field(default_factory=list)
    version: int = 0  # the version to go back to ("revert")
    lr_scale: float = 1.0  # of the configured learning rate, for this batch ("batch")


def resolved_config(cfg: TrainerConfig, model: str) -> TrainerConfig:
    """The trainer settings with model-dependent defaults filled in (the KL coefficient)."""
    if cfg.kl_coef is None:
        cfg = cfg.model_copy(update={"kl_coef": model_defaults(model).kl_coef})
    return cfg


class Trainer:
    """Consumes `liveloop:batches`, trains, and publishes a new policy version per batch."""

    def __init__(
        self,
        shared: SharedSettings,
        cfg: TrainerConfig,
        *,
        judging: JudgeConfig | None = None,
        metrics: TrainerMetrics | None = None,
        comm: Comm | None = None,
    ) -> None:
        self.shared = shared
        self.judging = judging or JudgeConfig()  # the promotion gate judges probe replies
        self.cfg = resolved_config(cfg, shared.model)
        self.metrics = metrics or TrainerMetrics()
        self.comm = comm or Comm()
        self.store = CheckpointStore(shared.checkpoints_dir, self.cfg.keep_checkpoints)
        self.state = TrainerState(version=0, parent=None)
        self.next_version = 1
        self.updater: PPOUpdater | None = None
        self.guards = Safeguards(self.cfg, shared, self.judging, self.metrics)
        self.quality: QualityStore | None = None
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
        """Load the policy from the newest accepted checkpoint (or the base model)."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no per-checkpoint progress bars in the logs
        accepted_only = self.cfg.gate.on_reject == "revert"
        latest = self.store.latest(accepted_only=accepted_only) if self.comm.is_main else None
        highest = max(self.store.versions(), default=0) if self.comm.is_main else 0
        latest, highest = self.comm.broadcast((latest, highest))
        self._load(latest)
        self.next_version = max(highest, self.version) + 1
        if latest is not None:
            log.info("resumed from checkpoint v%d", latest)

    def _load(self, version: int | None) -> None:
        """Weights, optimizer state and trainer state of a checkpoint (None: the base model)."""
        checkpoint = self.store.path_for(version) if version else None
        reference_teacher = self.cfg.objective != "rl" and self.cfg.opd.teacher == "reference"
        policy = load_policy(
            self.shared.model,
            self.cfg.device,
            self.cfg.lora,
            checkpoint=checkpoint,
            with_reference=bool(self.cfg.kl_coef)
            or self.cfg.measure_drift
            or self.guards.gated
            or reference_teacher,
        )
        if self.updater is not None:
            self.updater.close()
        self.updater = PPOUpdater(policy, self.cfg, self.comm, model_name=self.shared.model)
        if version:
            self.store.load_optimizer(version, self.updater.optimizer)
            self.state = self.store.load_state(version)
        else:
            self.state = TrainerState(version=0, parent=None)

    def _go_back(self, version: int) -> None:
        """The last accepted version again, after a refusal (without its momentum)."""
        self._load(version or None)
        if self.cfg.gate.drop_momentum:
            self._updater().drop_momentum()

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
                self._updater().update(message.samples, message.lr_scale)
            if message.kind == "revert":
                self._go_back(message.version)

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
        finally:
            if self.updater is not None:
                self.updater.close()  # the OPD teacher's HTTP client and threads

    async def _serve(self) -> None:
        client = await bus.connect(self.shared.require_redis("train"))
        registry = await asyncio.to_thread(Registry.open, self.shared.effective_db_url)
        run_id = await asyncio.to_thread(registry.start_run, "train", self._run_config())
        self.quality = QualityStore(client)
        reporter = QualityReporter(self.quality, registry, self.metrics.registry)
        reporting = asyncio.create_task(reporter.run(self.cfg.quality_interval_s))
        status = "failed"
        try:
            await self._start_gate(registry)
            await asyncio.to_thread(self.guards.start_watch, self.store, self.state)
            await self._lead_through_outages(client, registry, run_id)
            status = "finished"
        finally:
            reporting.cancel()
            await asyncio.gather(reporting, return_exceptions=True)
            await reporter.report()  # the last figures, after the last update
            await asyncio.to_thread(registry.finish_run, run_id, status)
            registry.close()
            await client.aclose()

    async def _start_gate(self, registry: Registry) -> None:
        """Probe version 0 and the serving version once, before the first update."""
        gate = await self.guards.start_gate(self._updater().policy, self.version)
        if gate is not None and gate.version0 is not None:
            probe = gate.version0.model_dump()
            await asyncio.to_thread(registry.record_version_quality, 0, probe=probe)

    async def _lead_through_outages(
        self, client: aredis.Redis, registry: Registry, run_id: int | None
    ) -> None:
        """Lead until stopped; a Redis outage is waited out (with backoff), not fatal.

        After one, the weights and state are reloaded from the newest checkpoint: an update
        may have run whose version was never announced nor its batch acknowledged, and
        the batch, delivered again, must not be applied on top of it a second time.
        """
        pause = RETRY_INITIAL_S
        transport = setup_weight_transport(self.shared.checkpoints_dir, client)
        while True:
            publisher = Publisher(transport, registry, run_id)
            source = BatchSource(
                client,
                self.shared.data_dir,
                consumer=self.cfg.consumer_name,
                claim_idle_ms=self.cfg.claim_idle_ms,
            )
            try:
                await source.start()
                log.info(
                    "training %s from v%d, reading %s as consumer %s%s",
                    self.shared.model, self.version, source.consumer.stream,
                    source.consumer.consumer, " (new versions pass the promotion gate)"
                    if self.guards.gated else "",
                )  # fmt: skip
                await self._reconcile(publisher)
                await self._lead(source, publisher)
                return
            except REDIS_ERRORS as exc:
                if self.comm.world > 1:  # the followers cannot reload with us: end the run
                    raise
                if self._stop.is_set():  # asked to stop: nothing to wait for
                    log.info("stopping during a Redis outage (%s)", exc)
                    return
                log.warning("Redis unavailable (%s); resuming in %.1fs", exc, pause)
                if await self._stopped_within(pause):
                    return
                pause = min(pause * 2, RETRY_MAX_S)
                await asyncio.to_thread(self.setup)

    async def _stopped_within(self, seconds: float) -> bool:
        """Wait `seconds`, or less if `stop()` is called meanwhile; True if it was."""
        deadline = time.monotonic() + seconds
        while not self._stop.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(min(0.25, max(deadline - time.monotonic(), 0.0)))
        return self._stop.is_set()

    def _run_config(self) -> dict[str, object]:
        secret = {"opd": {"endpoint": {"api_key"}}}  # the teacher's key stays out of the registry
        config = self.cfg.model_dump(exclude=secret)
        return {"model": self.shared.model, "world": self.comm.world, **config}

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
            await self._watch_served(publisher)
            item, message = await self._next_message(source)
            if self.comm.world > 1:
                await asyncio.to_thread(self.comm.broadcast, message)
            if message.kind == "stop":
                return
            if item is not None:
                await self._apply(item, message, source, publisher)

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
        samples = trainable_samples(
            item.samples, self.version, self.cfg.objective, self.shared.max_staleness, self.metrics
        )
        if not samples:
            await source.done(item)
            return None, StepMessage("idle")
        return item, StepMessage("batch", samples, lr_scale=self.guards.lr_scale())

    async def _apply(
        self,
        item: ReceivedBatch,
        message: StepMessage,
        source: BatchSource,
        publisher: Publisher,
    ) -> None:
        self.metrics.batch_wait.observe(max(time.time() - item.batch.created_at, 0.0))
        samples = message.samples
        stats = await asyncio.to_thread(self._updater().update, samples, message.lr_scale)
        if self.quality is not None:
            await self.quality.add_drift(stats.drift)
        policy = self._updater().policy
        weights = await asyncio.to_thread(policy.export)  # probed as served, then saved
        verdict = await self.guards.judge(policy, self.next_version, weights)
        started = time.perf_counter()
        metrics = stats.as_metrics()
        metrics["reward_mean"] = sum(s.score for s in samples) / len(samples)
        accepted = verdict is None or verdict.accepted
        state = TrainerState(
            version=self.next_version,
            parent=self.version,
            applied_batches=[*self.state.applied_batches, item.batch.batch_id],
            metrics=metrics,
            status="accepted" if accepted else "rejected",
            reason=verdict.reason if verdict else None,
        )
        path = await asyncio.to_thread(self._save, state, weights)
        del weights
        probe = verdict.probe.model_dump() if verdict is not None else None
        await publisher.publish(state, path, probe)
        self.next_version += 1
        if accepted:
            self.guards.went_live(state.version)
        if accepted or self.cfg.gate.on_reject == "continue":
            self.state = state
        else:
            await self._revert(self.version, state.applied_batches)
        protect = frozenset({self.version}) | self.guards.keep()
        pruned = await asyncio.to_thread(self.store.prune, protect)
        await asyncio.to_thread(publisher.forget, pruned, self.guards.awaiting())
        await source.done(item)
        self.updates_done += 1
        self.last_stats = stats
        self.metrics.publish_seconds.set(time.perf_counter() - started)
        self.metrics.observe_update(stats, self.version)
        log.info("v%d %s: %s", state.version, state.status, stats.describe())

    async def _revert(self, target: int, applied: list[str]) -> None:
        """Back to `target`'s weights and optimizer (on every rank), keeping the batches
        applied since (`applied`: consumed, never to be redone)."""
        if self.comm.world > 1:
            await asyncio.to_thread(self.comm.broadcast, StepMessage("revert", version=target))
        await asyncio.to_thread(self._go_back, target)
        self.state.applied_batches = applied

    # -- the served-quality watch (rank 0) -----------------------------------------------

    async def _watch_served(self, publisher: Publisher) -> None:
        """Every few seconds, compare the live versions' served reward; roll back if bad."""
        rollback = await self.guards.check_served(self.quality)
        if rollback is not None:
            await self._roll_back(rollback, publisher)

    async def _roll_back(self, rollback: Rollback, publisher: Publisher) -> None:
        """Publish the good version's weights again, as a new version (on every rank)."""
        log.warning("rolling back to v%d: %s", rollback.target, rollback.reason)
        await self._revert(rollback.target, self.state.applied_batches)
        state = TrainerState(
            version=self.next_version,
            parent=rollback.target,
            applied_batches=self.state.applied_batches,
            metrics=dict(self.state.metrics),
            reason=f"the weights of v{rollback.target} again: {rollback.reason}",
        )
        path = await asyncio.to_thread(self._save, state)
        await publisher.publish(state, path)
        await asyncio.to_thread(publisher.mark_rolled_back, rollback.reasons(state.version))
        self.state, self.next_version = state, self.next_version + 1
        self.guards.rolled_back(rollback, state.version)
        self.metrics.version.set(self.version)

    def _save(self, state: TrainerState, weights: Any = None) -> Path:
        """Checkpoint `state` with `weights` (the policy exported, by default)."""
        updater = self._updater()
        policy = updater.policy
        adapter = policy.model if policy.lora else None
        weights = weights if weights is not None else policy.export()
        return self.store.save(weights, policy.tokenizer, updater.optimizer, state, adapter=adapter)

"""The training loop: batches in, policy versions out, never waiting on the server.

`Trainer.run()` (rank 0) reads one batch, drops samples that are invalid or too stale for
the current version (or that the objective cannot learn from), runs one update
(`PPOUpdater`), and asks its safeguards (`liveloop.trainer.safeguards`) for a decision on
the new weights: serve or refuse. It writes checkpoint `v<N>` with the decision's status,
records it in the registry, announces it on `liveloop:weights`, goes on from the weights the
decision names (a refused version's predecessor, usually), prunes the checkpoints the
decision does not protect, and only then acknowledges the batch. Version numbers are never
reused. Between updates the safeguards' served-quality watch may decide to roll back:
`_roll_back` carries that out in one place. With several ranks, rank 0 broadcasts every
step's message (a batch, a revert, idle, or stop) and the others run `follow()`. After a
restart the trainer resumes from where its newest checkpoint says training went on:
weights, optimizer state, version, and the batch ids it has applied, so a re-delivered
batch is not trained twice. Alongside, it exports each version's quality on served traffic
(`liveloop.trainer.reporting`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
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
from liveloop.trainer.memory import release_freed_memory
from liveloop.trainer.metrics import TrainerMetrics
from liveloop.trainer.objectives import objective_class
from liveloop.trainer.policy import load_policy
from liveloop.trainer.ppo import PPOUpdater, UpdateStats
from liveloop.trainer.reporting import QualityReporter
from liveloop.trainer.safeguards.decisions import Decision
from liveloop.trainer.safeguards.guards import Safeguards
from liveloop.trainer.source import BatchSource, Publisher, ReceivedBatch, trainable_samples
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
        self.objective_class = objective_class(self.cfg.objective)  # a bad one stops start-up
        self.metrics = metrics or TrainerMetrics()
        self.comm = comm or Comm()
        self.store = CheckpointStore(shared.checkpoints_dir, self.cfg.keep_checkpoints)
        self.state = TrainerState(version=0, parent=None)
        self.next_version = 1
        self.updater: PPOUpdater | None = None
        self._cache: dict[str, Any] = {}  # what the objective keeps across policy reloads
        self.guards = Safeguards(self.cfg, shared, self.judging, self.metrics)
        self.lr_scale = 1.0  # of the configured rate, for the next update (decisions set it)
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
        """Load the policy from where the newest checkpoint says training went on (or the
        base model)."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no per-checkpoint progress bars in the logs
        latest = self.store.resume_point() if self.comm.is_main else None
        highest = max(self.store.versions(), default=0) if self.comm.is_main else 0
        latest, highest = self.comm.broadcast((latest, highest))
        self._load(latest)
        self.next_version = max(highest, self.version) + 1
        if latest is not None:
            log.info("resumed from checkpoint v%d", latest)

    def _load(self, version: int | None) -> None:
        """Weights, optimizer state and trainer state of a checkpoint (None: the base model)."""
        checkpoint = self.store.path_for(version) if version else None
        needs = self.objective_class.needs(self.cfg)
        policy = load_policy(
            self.shared.model,
            self.cfg.device,
            self.cfg.lora,
            checkpoint=checkpoint,
            with_reference=bool(self.cfg.kl_coef)
            or self.cfg.measure_drift
            or self.guards.gated
            or needs.reference,
        )
        if self.updater is not None:
            self.updater.close()
        self.updater = PPOUpdater(
            policy,
            self.cfg,
            self.comm,
            model_name=self.shared.model,
            cache=self._cache,
            tool_result_reminder=self.shared.effective_tool_result_reminder,
        )
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
        release_freed_memory()  # the refused policy's weights and optimizer state

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
        reporter = QualityReporter(
            self.quality, registry, self.metrics.registry, tenants=self._reported_tenants
        )
        reporting = asyncio.create_task(reporter.run(self.cfg.quality_interval_s))
        status = "failed"
        try:
            await self._start_gate(registry, client)
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

    async def _start_gate(self, registry: Registry, client: aredis.Redis) -> None:
        """Probe version 0 and the serving version once, before the first update."""
        gate = await self.guards.start_gate(self._updater().policy, self.version, client)
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
                self.cfg.consumer,
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
        if not await self._take(item, source):
            return None, StepMessage("idle")
        if item.batch.batch_id in self.state.applied_batches:
            log.info("batch %s was applied before a restart; acknowledging", item.batch.batch_id)
            self.metrics.dropped.labels("duplicate_batch").inc(len(item.samples))
            await source.done(item)
            return None, StepMessage("idle")
        samples = trainable_samples(
            item.samples,
            self.version,
            self._updater().objective,
            self.shared.max_staleness,
            self.metrics,
            lag=self._lag(),
        )
        if len(samples) < self.cfg.min_update_samples:
            await self._too_few(item, source, len(samples))
            return None, StepMessage("idle")
        return item, StepMessage("batch", samples, lr_scale=self.lr_scale)

    async def _too_few(self, item: ReceivedBatch, source: BatchSource, kept: int) -> None:
        """Acknowledge a batch that kept fewer samples than `min_update_samples`: no update."""
        if kept:
            log.info("batch %s%s kept %d samples, fewer than min_update_samples (%d): no update",
                     item.batch.batch_id, self.guards.whose, kept, self.cfg.min_update_samples)  # fmt: skip
            self.metrics.dropped.labels("too_few").inc(kept)
        await source.done(item)

    async def _take(self, item: ReceivedBatch, source: BatchSource) -> bool:
        """Whether `item` is trained here (tenant scope: the batch's tenant's adapter is
        made the one trained first); a batch not taken must be acknowledged here."""
        return True

    def _reported_tenants(self) -> list[str]:
        """Tenants whose base-served turns the quality reporter stores apart (tenant scope)."""
        return []

    def _lag(self) -> Callable[[BatchSample], int] | None:
        """How a sample's staleness is measured (None: versions behind `self.version`)."""
        return None

    async def _apply(
        self,
        item: ReceivedBatch,
        message: StepMessage,
        source: BatchSource,
        publisher: Publisher,
    ) -> None:
        self.metrics.batch_wait.observe(max(time.time() - item.batch.created_at, 0.0))
        samples = message.samples
        policy = self._updater().policy
        await self.guards.before_update(policy, self.version)
        stats = await asyncio.to_thread(self._updater().update, samples, message.lr_scale)
        if self.quality is not None:
            await self.quality.add_drift(stats.drift, tenant=self.guards.tenant)
        weights = await asyncio.to_thread(policy.export)  # probed as served, then saved
        decision = await self.guards.after_update(policy, self.next_version, weights, self.version)
        started = time.perf_counter()
        metrics = stats.as_metrics()
        metrics["reward_mean"] = sum(s.score for s in samples) / len(samples)
        state = TrainerState(
            version=self.next_version,
            parent=self.version,
            applied_batches=[*self.state.applied_batches, item.batch.batch_id],
            metrics=metrics,
            status=decision.status,
            reason=decision.reason,
            resume_from=decision.resume_from,
        )
        path = await asyncio.to_thread(self._save, state, weights)
        del weights
        probe = decision.probe.model_dump() if decision.probe is not None else None
        await publisher.publish(state, path, probe)
        self.next_version += 1
        self.lr_scale = decision.lr_scale
        if decision.status.servable:
            self.guards.went_live(state.version)
        if decision.resume_from == state.version:
            self.state = state
        else:
            await self._revert(decision.resume_from, state.applied_batches)
        await self._prune(decision, publisher)
        await source.done(item)
        self.updates_done += 1
        self.last_stats = stats
        self.metrics.publish_seconds.set(time.perf_counter() - started)  # announced by now
        await asyncio.to_thread(release_freed_memory)  # the merged copy, activations, logits
        self.metrics.observe_update(stats, self.version)
        log.info("v%d%s %s: %s", state.version, self.guards.whose, state.status, stats.describe())

    async def _prune(self, decision: Decision, publisher: Publisher) -> None:
        """Delete the checkpoints the decision does not protect, and their registry rows
        (a version the watch has yet to judge keeps its row until it has been)."""
        await asyncio.to_thread(self.store.prune, decision.protect | {self.version})
        on_disk = frozenset(await asyncio.to_thread(self.store.versions))
        tenant = self.guards.tenant
        await asyncio.to_thread(publisher.forget, on_disk, self.guards.awaiting(), tenant=tenant)

    async def _revert(self, target: int, applied: list[str]) -> None:
        """Back to `target`'s weights and optimizer (on every rank), keeping the batches
        applied since (`applied`: consumed, never to be redone)."""
        if self.comm.world > 1:
            await asyncio.to_thread(self.comm.broadcast, StepMessage("revert", version=target))
        await asyncio.to_thread(self._go_back, target)
        self.state.applied_batches = applied

    # -- the served-quality watch (rank 0) -----------------------------------------------

    async def _watch_served(self, publisher: Publisher) -> None:
        """Every few seconds, the watch looks at the live versions; roll back if it says so."""
        decision = await self.guards.check_served(self.quality)
        if decision is not None:
            await self._roll_back(decision, publisher)

    async def _roll_back(self, decision: Decision, publisher: Publisher) -> None:
        """A rollback, whole: the target's weights (on every rank) published again as a new
        version (servers only move forward), the abandoned versions marked rolled back in
        the registry with their reasons, the safeguards told, the next update slowed."""
        rollback = decision.rollback
        assert rollback is not None
        log.warning(
            "rolling back%s to v%d: %s", self.guards.whose, rollback.target, rollback.reason
        )
        await self._revert(decision.resume_from, self.state.applied_batches)
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
        self.lr_scale = decision.lr_scale
        self.guards.rolled_back(rollback, state.version)
        self.metrics.version.set(self.version)

    def _save(self, state: TrainerState, weights: Any = None) -> Path:
        """Checkpoint `state` with `weights` (the policy exported, by default), or, when
        versions are published as adapters, with the policy's adapter alone."""
        updater = self._updater()
        policy = updater.policy
        adapter = policy.model if policy.lora else None
        name = self.cfg.lora.adapter_name if self.cfg.publishes_adapters else None
        if name is None and weights is None:
            weights = policy.export()
        return self.store.save(
            weights, policy.tokenizer, updater.optimizer, state, adapter=adapter,
            publish_adapter=name,
        )  # fmt: skip

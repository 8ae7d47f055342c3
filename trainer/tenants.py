"""Tenant scope: one LoRA adapter per tenant over one frozen base, each learning alone.

`TenantTrainer` is the training loop (`Trainer`) with one *lane* per tenant. A lane holds
what is the tenant's own: its checkpoints (`<checkpoints>/tenants/<tenant>/v<N>`, version
numbers global), its trainer state (version, applied batches), the history of its
versions (staleness is counted in them, `liveloop.tenants.tenant_lag`), its learning-rate
factor, and its safeguards: a promotion gate probing with the tenant's own recent prompts
and a served-quality watch over its own versions (the base among them measured on the
tenant's own turns, `liveloop.quality`), so one tenant's refusal or rollback never touches
another's adapter.

There is one model in memory, the base wrapped with one trainable LoRA adapter, and one
optimizer. Before a tenant's batch is trained, that tenant's adapter weights and optimizer
state are put into them (`_enter`): copied back from memory when the tenant is warm, else
read from its newest checkpoint (every version is a checkpoint with its optimizer state,
so nothing is lost when a lane goes cold), else a fresh adapter (the LoRA initialisation,
a zero update: the base model) with an empty optimizer state. Swapping tensors of one
adapter rather than keeping many named PEFT adapters keeps the updater, the gate and the
objectives unchanged: they see one policy. At most `trainer.max_warm_tenants` lanes keep
their weights and optimizer state in memory; past it the least recently trained lane's
are dropped. The KL anchor stays the base (`Policy.reference_logprobs` disables the
adapter). Batches are trained in the order the collector published them, which in tenant
scope takes the tenant that has waited longest first, one batch each, so a tenant's burst
cannot hold back the others. Each version is published as the adapter named after its
tenant, with the tenant set, so servers route only that tenant's requests to it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis.asyncio as aredis

from liveloop.config import ConfigError, JudgeConfig, SharedSettings, TrainerConfig
from liveloop.contracts import BatchSample
from liveloop.registry import Registry
from liveloop.tenants import tenant_checkpoints, tenant_lag, tenants_on_disk, valid_tenant
from liveloop.trainer.checkpoints import CheckpointStore, TrainerState
from liveloop.trainer.dist import Comm
from liveloop.trainer.loop import StepMessage, Trainer
from liveloop.trainer.metrics import TrainerMetrics
from liveloop.trainer.safeguards.decisions import Decision
from liveloop.trainer.safeguards.guards import Safeguards
from liveloop.trainer.source import BatchSource, Publisher, ReceivedBatch
from liveloop.trainer.tenant_metrics import TenantMetrics
from liveloop.weights import SharedDiskTransport

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass
class Warm:
    """A lane's adapter weights and optimizer state, kept in memory while it is not trained."""

    adapter: dict[str, torch.Tensor]
    optimizer: dict[str, Any]


@dataclass
class TenantLane:
    """What one tenant's adapter has of its own."""

    tenant: str
    store: CheckpointStore
    guards: Safeguards
    state: TrainerState = field(default_factory=lambda: TrainerState(version=0, parent=None))
    versions: list[int] = field(default_factory=list)  # its versions, sorted
    lr_scale: float = 1.0
    warm: Warm | None = None
    used_at: float = 0.0  # monotonic time it was last trained
    gated: bool = False  # its gate has drawn its probes and probed its serving version
    watched: bool = False  # its served-quality watch is set up

    def lag(self, sample: BatchSample) -> int:
        """The updates of this tenant's adapter since `sample` was produced."""
        return tenant_lag(sample.min_version, self.versions)


class TenantTrainer(Trainer):
    """The training loop of tenant scope (see the module docstring)."""

    def __init__(
        self,
        shared: SharedSettings,
        cfg: TrainerConfig,
        *,
        judging: JudgeConfig | None = None,
        metrics: TrainerMetrics | None = None,
        comm: Comm | None = None,
    ) -> None:
        super().__init__(shared, cfg, judging=judging, metrics=metrics, comm=comm)
        if self.comm.world > 1:
            raise ConfigError("trainer.scope = 'tenant' trains in one process (world size 1)")
        self.lanes: dict[str, TenantLane] = {}
        self.lane: TenantLane | None = None
        self.root_store = self.store
        self._fresh: dict[str, torch.Tensor] = {}
        self._client: aredis.Redis | None = None
        self.guards = self._idle_guards()
        self.tenant_metrics = TenantMetrics(self.metrics.registry)

    def _idle_guards(self) -> Safeguards:
        """Safeguards with nothing to do: those outside any lane (each lane has its own)."""
        off = {"gate": self.cfg.gate.model_copy(update={"enabled": False}),
               "watch": self.cfg.watch.model_copy(update={"enabled": False})}  # fmt: skip
        return Safeguards(self.cfg.model_copy(update=off), self.shared, self.judging, self.metrics)

    # -- set-up ------------------------------------------------------------------------------

    def setup(self) -> None:
        """The base model with a fresh adapter; the tenants found on disk, cold."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.lanes.clear()
        self.lane = None
        self.store, self.guards = self.root_store, self._idle_guards()
        super()._load(None)
        model = self._updater().policy.model
        self._fresh = {
            n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad
        }
        highest = max(self.root_store.versions(), default=0)
        for tenant in tenants_on_disk(self.shared.checkpoints_dir):
            lane = self._lane(tenant)
            highest = max([highest, *SharedDiskTransport(lane.store.root).version_dirs()])
        self.next_version = highest + 1

    def _lane(self, tenant: str) -> TenantLane:
        lane = self.lanes.get(tenant)
        if lane is None:
            root = tenant_checkpoints(self.shared.checkpoints_dir, tenant)
            store = CheckpointStore(root, self.cfg.keep_checkpoints)
            guards = Safeguards(self.cfg, self.shared, self.judging, self.metrics, tenant=tenant)
            lane = TenantLane(tenant, store, guards, versions=store.versions())
            self.lanes[tenant] = lane
        return lane

    async def _start_gate(self, registry: Registry, client: aredis.Redis) -> None:
        """Each lane's gate starts when its tenant's first batch comes (`_enter`)."""
        self._client = client

    async def _reconcile(self, publisher: Publisher) -> None:
        """Every tenant's version training goes on from is recorded and announced, and its
        watch looks at its served versions from now on (not only once its next batch comes)."""
        for lane in list(self.lanes.values()):
            version = await asyncio.to_thread(lane.store.resume_point)
            if not version:
                continue
            path = lane.store.path_for(version)
            lane.state = await asyncio.to_thread(lane.store.load_state, version)
            state = lane.state
            await asyncio.to_thread(publisher.record, version, path, state.parent, state.metrics)
            await publisher.announce(version, path, state.parent, state.metrics)
            await self._start_watch(lane, state)

    async def _start_watch(self, lane: TenantLane, state: TrainerState) -> None:
        if not lane.watched:
            lane.watched = True
            await asyncio.to_thread(lane.guards.start_watch, lane.store, state)

    # -- switching lanes ---------------------------------------------------------------------

    async def _enter(self, lane: TenantLane) -> None:
        """Make `lane`'s adapter, optimizer state and safeguards the ones trained."""
        lane.used_at = time.monotonic()
        if self.lane is not lane:
            if self.lane is not None:
                self._leave(self.lane)
            self.lane = lane
            self.store, self.guards, self.lr_scale = lane.store, lane.guards, lane.lr_scale
            if lane.warm is not None:
                await asyncio.to_thread(self._restore, lane.warm)
                self.state, lane.warm = lane.state, None
            else:  # cold (or new): its newest checkpoint is where it stands (or the base)
                await asyncio.to_thread(self._put_adapter, lane.store.resume_point())
                lane.state = self.state
            self._cool_down()
        if not lane.gated:
            lane.gated = True
            policy = self._updater().policy
            await lane.guards.start_gate(policy, self.version, self._client)
        await self._start_watch(lane, self.state)

    def _leave(self, lane: TenantLane) -> None:
        """Keep the lane being left in memory (its weights and optimizer state)."""
        model = self._updater().policy.model
        adapter = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        optimizer = copy.deepcopy(self._updater().optimizer.state_dict())
        lane.warm = Warm(adapter, optimizer)
        lane.state, lane.lr_scale = self.state, self.lr_scale

    def _cool_down(self) -> None:
        """Past `max_warm_tenants` lanes in memory, drop the least recently trained ones'
        (their adapters, optimizer states and the gate's kept reference prompts)."""
        warm = sorted(
            (x for x in self.lanes.values() if x.warm is not None), key=lambda x: x.used_at
        )
        for lane in warm[: max(len(warm) + 1 - self.cfg.max_warm_tenants, 0)]:
            lane.warm = None
            if lane.guards.gate is not None:  # its prompts' reference keys and values too
                lane.guards.gate.reference_prompts.clear()
            log.info("tenant %s's adapter leaves memory (read back from v%d)",
                     lane.tenant, lane.state.version)  # fmt: skip

    def _restore(self, warm: Warm) -> None:
        import torch

        with torch.no_grad():
            for name, param in self._updater().policy.model.named_parameters():
                if param.requires_grad:
                    param.copy_(warm.adapter[name])
        self._updater().optimizer.load_state_dict(warm.optimizer)

    def _put_adapter(self, version: int | None) -> None:
        """The lane's adapter and optimizer state at `version` (None or 0: a fresh one)."""
        if not version:
            self._restore(Warm(self._fresh, {"state": {}, "param_groups": self._groups()}))
            self.state = TrainerState(version=0, parent=None)
            return
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights

        path = self.store.path_for(version)
        device = str(next(self._updater().policy.model.parameters()).device)
        set_peft_model_state_dict(
            self._updater().policy.model, load_peft_weights(str(path), device)
        )
        self.store.load_optimizer(version, self._updater().optimizer)
        self.state = self.store.load_state(version)

    def _groups(self) -> list[dict[str, Any]]:
        groups = self._updater().optimizer.state_dict()["param_groups"]
        return copy.deepcopy(groups)

    def _load(self, version: int | None) -> None:
        """Within a lane, going back to one of its versions swaps the adapter in place."""
        if self.lane is None or self.updater is None:
            super()._load(version)
        else:
            self._put_adapter(version)

    # -- the loop's hooks --------------------------------------------------------------------

    async def _take(self, item: ReceivedBatch, source: BatchSource) -> bool:
        tenant = item.batch.tenant
        if tenant is None or not valid_tenant(tenant):
            log.warning("batch %s names no tenant (trainer.scope = 'tenant'); dropped",
                        item.batch.batch_id)  # fmt: skip
            self.metrics.dropped.labels("no_tenant").inc(len(item.samples))
            await source.done(item)
            return False
        self._forget_deleted()
        await self._enter(self._lane(tenant))
        return True

    def _lag(self) -> Callable[[BatchSample], int] | None:
        return self._active().lag

    def _reported_tenants(self) -> list[str]:
        return list(self.lanes)

    def _active(self) -> TenantLane:
        if self.lane is None:
            raise RuntimeError("no tenant's adapter is being trained")
        return self.lane

    async def _apply(
        self,
        item: ReceivedBatch,
        message: StepMessage,
        source: BatchSource,
        publisher: Publisher,
    ) -> None:
        lane = self._active()
        refusals = lane.guards.rejected
        await super()._apply(item, message, source, publisher)
        lane.state, lane.lr_scale = self.state, self.lr_scale
        reward = sum(s.score for s in message.samples) / len(message.samples)
        refused = lane.guards.rejected > refusals
        self.tenant_metrics.trained(
            lane.tenant, self.version, reward, len(message.samples), refused=refused
        )

    async def _roll_back(self, decision: Decision, publisher: Publisher) -> None:
        await super()._roll_back(decision, publisher)
        lane = self._active()
        lane.state, lane.lr_scale = self.state, self.lr_scale
        self.tenant_metrics.rolled_back(self._active().tenant, self.version)

    async def _watch_served(self, publisher: Publisher) -> None:
        """Each started lane's watch looks at its own versions; a rollback is its own."""
        self._forget_deleted()
        for lane in list(self.lanes.values()):
            if lane.guards.watch is None:
                continue
            decision = await lane.guards.check_served(self.quality)
            if decision is not None:
                await self._enter(lane)
                await self._roll_back(decision, publisher)

    def _save(self, state: TrainerState, weights: Any = None) -> Path:
        """The lane's adapter alone, named after its tenant, with its tenant set."""
        lane = self._active()
        updater = self._updater()
        path = self.store.save(
            weights, updater.policy.tokenizer, updater.optimizer, state,
            adapter=updater.policy.model, publish_adapter=lane.tenant, tenant=lane.tenant,
        )  # fmt: skip
        if state.version not in lane.versions:
            lane.versions = sorted([*lane.versions, state.version])
        return path

    def _forget_deleted(self) -> None:
        """Lanes of tenants deleted meanwhile (their checkpoints are gone): their adapters
        leave memory at once; a tenant that comes back starts over from the base."""
        for lane in list(self.lanes.values()):
            if lane.versions and not lane.store.root.exists():
                log.info("tenant %s was deleted: its adapter leaves the trainer", lane.tenant)
                self.forget_tenant(lane.tenant)

    def forget_tenant(self, tenant: str) -> None:
        """A deleted tenant's lane (its files are removed by whoever deleted it)."""
        lane = self.lanes.pop(tenant, None)
        self.tenant_metrics.forget(tenant)
        if lane is not None and lane is self.lane:
            self.lane = None
            self.store, self.guards = self.root_store, self._idle_guards()
            self._put_adapter(None)  # its weights and optimizer state leave the model too

"""The collecting loop: judged turns in, staleness-bounded token-packed batches out.

Each step reads `liveloop:scored` (consumer group `collector`), rejects turns that cannot be
trained on (side turns, empty or malformed ones, turns more than `max_staleness` versions
behind the trainer), holds the rest in their prompt group for `group_wait_s`, assigns
advantages when a group closes, and packs ready turns into batches. At most
`max_queued_batches` wait for the trainer: while that many do, ready turns are held, and the
next batch is packed from the freshest of them, so a trainer slower than the traffic always
trains on fresh batches. In tenant scope (`trainer.scope`) a batch holds one tenant's turns,
staleness counts the updates of that tenant's adapter, and the tenant whose turns waited
longest is packed first. A turn's stream entry
is acknowledged only once the batch holding it is published (or once it is rejected), so a
crash loses nothing: the collector's pending entries come back to it on restart, and the
batch writer refuses turns that were already published. Nothing here waits on the server
or the trainer: the trainer's version is a cached read of `liveloop:weights`. The running
reward baselines are kept in Redis (`liveloop:collector:baselines`), written after each step
that moved them and read back at start, so a restarted collector goes on from them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import redis
import redis.asyncio as aredis
from pydantic import ValidationError

from liveloop import bus
from liveloop.bus import keys
from liveloop.collector.advantages import Baselines, GroupAssembler, PendingSample
from liveloop.collector.call_credit import CallCredit
from liveloop.collector.metrics import CollectorMetrics
from liveloop.collector.packing import Bin, FlushPolicy
from liveloop.collector.versions import TrainerVersion
from liveloop.collector.writer import BatchWriter
from liveloop.config import CollectorConfig, SharedSettings
from liveloop.contracts import ScoredTurn
from liveloop.samples import min_version, staleness, untrainable
from liveloop.tenants import (
    TenantVersions,
    split_tenant_baselines,
    tenant_baseline_name,
    valid_tenant,
)

log = logging.getLogger(__name__)

RETRY_INITIAL_S = 0.5
RETRY_MAX_S = 10.0
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
IDLE_BLOCK_MS = 1000
BUSY_BLOCK_MS = 100


def reject_reason(turn: ScoredTurn) -> str | None:
    """Why a judged turn can never be trained on (a metric label), or None."""
    if turn.turn_type == "side":
        return "side"
    problem = untrainable(turn)
    return problem.reason if problem is not None else None


class Collector:
    """Turns `liveloop:scored` into `liveloop:batches`; call `run()`, stop with `stop()`."""

    def __init__(
        self,
        shared: SharedSettings,
        cfg: CollectorConfig,
        client: aredis.Redis,
        *,
        metrics: CollectorMetrics | None = None,
        trainer_version: TrainerVersion | None = None,
        tenant_scope: bool = False,
    ) -> None:
        self.cfg = cfg
        # Tenant scope: a batch holds one tenant's turns, staleness counts its own versions.
        self.tenant_versions = TenantVersions(client) if tenant_scope else None
        self.max_staleness = shared.max_staleness
        self.client = client
        self.metrics = metrics or CollectorMetrics()
        self.consumer = bus.StreamConsumer(
            client,
            bus.SCORED,
            bus.COLLECTOR_GROUP,
            cfg.consumer.name,
            claim_idle_ms=cfg.consumer.claim_idle_ms,
            count=cfg.consumer.read_count,
        )
        self.versions = trainer_version or TrainerVersion(client, poll_s=cfg.version_poll_s)
        self.writer = BatchWriter(client, shared.data_dir, cfg.inline_max_bytes)
        self.groups = GroupAssembler(cfg.group_wait_s)
        self.calls = CallCredit(cfg.call_credit, cfg.call_credit_wait_s)
        self.baselines = Baselines(
            cfg.baseline_decay,
            scope=cfg.baseline_scope,
            min_task_turns=cfg.baseline_min_task_turns,
            max_tasks=cfg.baseline_max_tasks,
            per_judge=cfg.baseline_per_judge,
        )
        self.tenant_baselines: dict[str, Baselines] = {}  # tenant scope: each tenant's own
        self.policy = FlushPolicy(cfg.token_budget, cfg.min_turns, cfg.min_fill, cfg.max_wait_s)
        self.ready: list[PendingSample] = []
        self.held = self.consumer.in_flight  # entries held until their batch is published
        self._held_keys: set[str] = set()
        self._stop = threading.Event()
        self._started = False
        self._kept_alive_at = time.monotonic()

    def stop(self) -> None:
        """Finish after the current step; held turns stay pending and come back on restart."""
        self._stop.set()

    async def start(self) -> None:
        """Create the consumer group and read the trainer's version."""
        await self.consumer.ensure_group()
        stored: Any = await self.client.hgetall(keys.COLLECTOR_BASELINES)
        shared, by_tenant = split_tenant_baselines({str(k): str(v) for k, v in stored.items()})
        self.baselines.load(shared)
        for tenant, state in by_tenant.items():
            self._baselines_of(tenant).load(state)
        for judge, baseline in self.baselines.by_judge.items():
            self.metrics.baseline.labels(judge).set(baseline.value)
        if self.baselines.by_judge:
            log.info(
                "reward baselines restored for %s (and %d tasks)",
                ", ".join(sorted(self.baselines.by_judge)), len(self.baselines.by_task),
            )  # fmt: skip
        version = await self.versions.current(force=True)
        self.metrics.trainer_version.set(version)
        log.info(
            "collecting %s into batches of up to %d tokens as consumer %s "
            "(trainer at v%d, turns more than %d versions behind are dropped)",
            self.consumer.stream, self.cfg.token_budget, self.consumer.consumer,
            version, self.max_staleness,
        )  # fmt: skip

    async def run(self) -> None:
        """Step until `stop()`; a Redis outage is waited out (with backoff), not fatal."""
        pause = RETRY_INITIAL_S
        while not self._stop.is_set():
            try:
                if not self._started:
                    await self.start()
                    self._started = True
                await self.step()
                pause = RETRY_INITIAL_S
            except REDIS_ERRORS as exc:
                log.warning("Redis unavailable (%s); retrying in %.1fs", exc, pause)
                self._forget_held()
                await asyncio.sleep(pause)
                pause = min(pause * 2, RETRY_MAX_S)

    def _forget_held(self) -> None:
        """Drop what is held in memory after a failed step, as a restart would: the held
        turns are still pending in the group and come back (re-read from the start of our
        pending list); those already in a published batch are then acknowledged as such."""
        self.groups = GroupAssembler(self.cfg.group_wait_s)
        self.calls = CallCredit(self.cfg.call_credit, self.cfg.call_credit_wait_s)
        self.ready = []
        self.held.clear()
        self._held_keys.clear()
        self._started = False
        self.consumer.restart()

    async def step(self, block_ms: int | None = None) -> None:
        """Read what arrived, close due groups, publish the batches that are ready."""
        if block_ms is None:
            block_ms = BUSY_BLOCK_MS if self.held else IDLE_BLOCK_MS
        if len(self.held) < self.cfg.max_held_turns:
            entries = await self.consumer.read(block_ms=block_ms)
        else:  # hold no more: new turns wait in Redis until some are published or dropped
            entries = []
            await asyncio.sleep(block_ms / 1000)
        now = time.monotonic()
        await self._keep_held(now)
        await self._intake(entries, now)
        moved: dict[str | None, set[str]] = {}
        for group in self._credited(self.groups.pop_closed(now), now):
            tenant = group[0].turn.tenant if self.tenant_versions is not None else None
            baselines = self._baselines_of(tenant)
            baselines.assign(group)
            for p in group:
                judge = baselines.judge_of(p.turn)
                moved.setdefault(tenant, set()).add(judge)
                self.metrics.reward.labels(str(p.main_version)).observe(p.turn.score)
                if tenant is None:  # per tenant, the label set would be unbounded
                    self.metrics.baseline.labels(judge).set(baselines.get(judge).value)
            self.ready.extend(group)
        await self._store_baselines(moved)
        await self._flush(now)
        self.metrics.pending.set(len(self.held))

    def _credited(self, closed: list[list[PendingSample]], now: float) -> list[list[PendingSample]]:
        """The closed groups ready for advantages: lone tool calls wait for their answer's
        judgment (`CallCredit`), those released now join."""
        credited, expired = self.calls.credited, self.calls.expired
        ready = self.calls.route(closed, now)
        self.metrics.credited_calls.labels("answered").inc(self.calls.credited - credited)
        self.metrics.credited_calls.labels("expired").inc(self.calls.expired - expired)
        self.metrics.waiting_calls.set(len(self.calls))
        return ready

    def _baselines_of(self, tenant: str | None) -> Baselines:
        """The reward baselines a turn is measured against: in tenant scope its tenant's
        own (another tenant's scores never enter its advantages), else the shared ones."""
        if tenant is None:
            return self.baselines
        found = self.tenant_baselines.get(tenant)
        if found is None:
            b = self.baselines
            found = Baselines(b.decay, scope=b.scope, min_task_turns=b.min_task_turns,
                              max_tasks=b.max_tasks, per_judge=b.per_judge)  # fmt: skip
            self.tenant_baselines[tenant] = found
        return found

    async def _store_baselines(self, moved: dict[str | None, set[str]]) -> None:
        """Write the baselines that moved (and drop those no longer kept) in Redis."""
        named: list[tuple[str | None, Baselines]] = [(None, self.baselines)]
        named += list(self.tenant_baselines.items())
        dropped = [tenant_baseline_name(t, n) for t, b in named for n in b.take_dropped()]
        if dropped:  # before the write: one may be back
            await self.client.hdel(keys.COLLECTOR_BASELINES, *dropped)
        state: dict[str, str] = {}
        for tenant, judges in moved.items():
            for name, value in self._baselines_of(tenant).dump(judges).items():
                state[tenant_baseline_name(tenant, name)] = value
        if state:
            await self.client.hset(keys.COLLECTOR_BASELINES, mapping=state)  # type: ignore[arg-type]

    async def _forget_tenant(self, tenant: str) -> None:
        """A deleted tenant: the turns of it held here never make a batch (their entries,
        deleted from the stream, are acknowledged), and its baselines go."""
        held = [p for p in self.ready if p.turn.tenant == tenant]
        held += self.groups.drop_tenant(tenant)
        held += self.calls.drop_tenant(tenant)
        self.ready = [p for p in self.ready if p.turn.tenant != tenant]
        self.tenant_baselines.pop(tenant, None)
        if held:
            log.info("tenant %s was deleted: %d held turns dropped", tenant, len(held))
            self.metrics.dropped.labels("deleted").inc(len(held))
            await self._release(held)

    def _behind(self, turn: ScoredTurn, version: int) -> int:
        """How many versions the turn lags: behind the trainer, or, in tenant scope, behind
        its tenant's adapter (the updates it went through since)."""
        if self.tenant_versions is not None:
            return self.tenant_versions.lag(turn.tenant, min_version(turn))
        return staleness(turn, version)

    async def _intake(self, entries: list[bus.Entry], now: float) -> None:
        version = await self.versions.current()
        self.metrics.trainer_version.set(version)
        if self.tenant_versions is not None:
            await self.tenant_versions.refresh()
            for tenant in self.tenant_versions.take_withdrawn():
                await self._forget_tenant(tenant)
        acks: list[str] = []
        candidates: list[PendingSample] = []
        for entry in entries:
            self.metrics.turns.inc()
            try:
                turn = entry.parse(ScoredTurn)
            except (ValidationError, ValueError) as exc:
                await self.consumer.dead_letter(entry, f"unreadable scored turn: {exc}")
                continue
            reason = reject_reason(turn)
            if (
                reason is None
                and self.tenant_versions is not None
                and not valid_tenant(turn.tenant)
            ):
                reason = "invalid"
            if reason is None:
                behind = self._behind(turn, version)
                self.metrics.staleness.observe(max(behind, 0))
                if behind > self.max_staleness:
                    reason = "stale"
            if reason is not None:
                self.metrics.dropped.labels(reason).inc()
                acks.append(entry.id)
                continue
            candidates.append(PendingSample(entry.id, turn, now))
        published = await self.writer.already_batched([c.key for c in candidates])
        for c in candidates:
            if c.key in published or c.key in self._held_keys:
                self.metrics.dropped.labels("duplicate").inc()
                acks.append(c.entry_id)
                continue
            self.groups.add(c)
            self.held.add(c.entry_id)
            self._held_keys.add(c.key)
        await self.consumer.ack(*acks)

    async def _release(self, samples: list[PendingSample]) -> None:
        """Acknowledge and forget samples that are published or dropped."""
        for p in samples:
            self.held.discard(p.entry_id)
            self._held_keys.discard(p.key)
        await self.consumer.ack(*[p.entry_id for p in samples])

    async def _flush(self, now: float) -> None:
        if not self.policy.worth_packing(self.ready, now):
            return
        version = await self.versions.current()
        if self.tenant_versions is not None:
            await self.tenant_versions.refresh()
        stale = [p for p in self.ready if self._behind(p.turn, version) > self.max_staleness]
        if stale:
            self.metrics.dropped.labels("stale").inc(len(stale))
            await self._release(stale)
            gone = {p.entry_id for p in stale}
            self.ready = [p for p in self.ready if p.entry_id not in gone]
        room = await self._room()
        if not self.ready or room == 0:
            return
        if self.tenant_versions is not None:
            await self._flush_tenants(now, version, room)
            return
        ship, self.ready = self.policy.split(self.ready, now, room)
        for b in ship:
            await self._publish(b, version, now)

    async def _flush_tenants(self, now: float, version: int, room: int | None) -> None:
        """Batches of one tenant's turns each: the tenant whose turns have waited longest
        first, one batch per tenant while the trainer's queue is bounded (`room`), so one
        tenant's burst never holds back the others."""
        by_tenant: dict[str, list[PendingSample]] = {}
        for p in self.ready:
            by_tenant.setdefault(p.turn.tenant, []).append(p)
        waited = sorted(by_tenant, key=lambda t: min(p.arrived_at for p in by_tenant[t]))
        self.ready = []
        for tenant in waited:
            samples = by_tenant[tenant]
            if room == 0 or not self.policy.worth_packing(samples, now):
                self.ready.extend(samples)
                continue
            ship, keep = self.policy.split(samples, now, None if room is None else 1)
            self.ready.extend(keep)
            for b in ship:
                await self._publish(b, version, now, tenant)
            if room is not None:
                room -= len(ship)

    async def _room(self) -> int | None:
        """How many batches may be published now: `max_queued_batches` minus those the
        trainer has not read yet (None: no bound)."""
        limit = self.cfg.max_queued_batches
        if limit is None:
            return None
        waiting = await self.writer.waiting()
        self.metrics.queued_batches.set(waiting)
        return max(limit - waiting, 0)

    async def _keep_held(self, now: float) -> None:
        """Turns may be held for a while (the trainer's queue is full): keep their entries
        from looking idle, so that no other collector reclaims them meanwhile."""
        if self.held and now - self._kept_alive_at >= self.cfg.consumer.claim_idle_ms / 4000:
            self._kept_alive_at = now
            await self.consumer.keep_alive()

    async def _publish(self, b: Bin, version: int, now: float, tenant: str | None = None) -> None:
        samples = [p.to_batch_sample() for p in b.samples]
        result = await self.writer.write(samples, version, tenant=tenant)
        if result.status in ("ok", "dup"):
            if result.status == "ok":
                self.metrics.batches.inc()
                self.metrics.batched_turns.inc(len(b.samples))
                self.metrics.hinted_turns.inc(sum(bool(p.turn.directive_hint) for p in b.samples))
                self.metrics.batch_tokens.observe(b.tokens)
                self.metrics.batch_wait.observe(now - b.oldest)
                if result.batch.path is not None:
                    self.metrics.by_reference.inc()
            await self._release(b.samples)
            return
        # Some turn is already in a published batch (a second collector got there first).
        taken = await self.writer.already_batched([p.key for p in b.samples])
        dupes = [p for p in b.samples if p.key in taken]
        self.metrics.dropped.labels("duplicate").inc(len(dupes))
        await self._release(dupes)
        self.ready.extend(p for p in b.samples if p.key not in taken)

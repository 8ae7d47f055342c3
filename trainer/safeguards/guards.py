"""What stands between a trained version and its users: the promotion gate and the watch.

The trainer owns one `Safeguards` and asks it for decisions (`liveloop.trainer.safeguards.
decisions`). After each update, `after_update()` has the promotion gate probe the new weights
and returns *serve* or *refuse*, with the version training goes on from (a refused one's
predecessor, or the refused weights themselves under `on_reject = "continue"`). Between
updates, `check_served()` has the served-quality watch compare the live versions' served
reward and reference NLL, and returns *roll back* after a clear fall. Every decision says
how carefully the next update steps (`lr_scale`: smaller after each refusal or rollback in a
row) and which checkpoints pruning must keep. The loop applies decisions; it never reads
the gate's or the watch's settings to work them out, and tells the safeguards what it did
(`went_live`, `rolled_back`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import redis.asyncio as aredis

from liveloop.config import JudgeConfig, SharedSettings, TrainerConfig
from liveloop.config.defaults import model_defaults
from liveloop.prm.sense import LLMSenseCheck
from liveloop.probe_sources import ProbeContext
from liveloop.quality import QualityStore
from liveloop.tenants import of_tenant
from liveloop.trainer.checkpoints import CheckpointStore, TrainerState
from liveloop.trainer.metrics import TrainerMetrics
from liveloop.trainer.safeguards.decisions import Decision, Rollback, Verdict
from liveloop.trainer.safeguards.gate import PromotionGate, build_panel
from liveloop.trainer.safeguards.sources import probe_source_class
from liveloop.trainer.safeguards.watch import ServedWatch

if TYPE_CHECKING:
    from liveloop.trainer.policy import Policy

log = logging.getLogger(__name__)


class Safeguards:
    """The promotion gate and the served-quality watch of one trainer, with their counters."""

    def __init__(
        self,
        cfg: TrainerConfig,
        shared: SharedSettings,
        judging: JudgeConfig,
        metrics: TrainerMetrics,
        *,
        tenant: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.tenant = tenant  # tenant scope: probe with this tenant's own traffic only
        self.shared = shared
        self.judging = judging
        self.metrics = metrics
        # A bad probe source stops start-up, like a bad objective.
        self.probe_source = probe_source_class(cfg.gate) if cfg.gate.enabled else None
        self.gate: PromotionGate | None = None
        self.watch: ServedWatch | None = None
        self.rejected = 0
        self.refusals_in_row = 0  # refusals (and rollbacks) since the last accepted version
        self._next_watch = 0.0  # monotonic time of the watch's next look at served counters

    @property
    def whose(self) -> str:
        """Whose versions these are, for log lines: "of tenant <id>" in tenant scope."""
        return of_tenant(self.tenant)

    @property
    def gated(self) -> bool:
        """True when new versions pass the promotion gate before they are announced."""
        return self.cfg.gate.enabled

    def lr_scale(self) -> float:
        """Learning-rate factor of the next update: smaller after each refusal in a row."""
        gate = self.cfg.gate
        return max(gate.reject_lr_scale**self.refusals_in_row, gate.min_lr_scale)

    def protect(self, *versions: int) -> frozenset[int]:
        """Checkpoints pruning must keep: `versions`, and those the watch may go back to."""
        return frozenset(versions) | (self.watch.keep() if self.watch is not None else frozenset())

    def awaiting(self) -> frozenset[int]:
        """Live versions the watch has yet to judge (their registry rows must stay)."""
        return frozenset(self.watch.pending) if self.watch is not None else frozenset()

    # -- start-up -------------------------------------------------------------------------

    async def start_gate(
        self, policy: Policy, serving_version: int, redis: aredis.Redis | None = None
    ) -> PromotionGate | None:
        """Draw the probes; probe version 0 and the serving version once, before any update."""
        if self.probe_source is None:
            return None
        source = self.probe_source(
            ProbeContext(self.cfg.gate, self.shared, redis, tenant=self.tenant)
        )
        panel = build_panel(self.judging, self.shared)
        sense = self.cfg.gate.sense
        check = LLMSenseCheck.from_settings(sense) if sense.base_url else None
        self.gate = PromotionGate(
            self.shared.model,
            self.cfg.gate,
            panel,
            source,
            check,
            tool_result_reminder=self.shared.effective_tool_result_reminder,
        )
        await self.gate.start(policy, serving_version)
        return self.gate

    def start_watch(self, store: CheckpointStore, state: TrainerState) -> None:
        """The watch (if enabled), with the reference-NLL bound where served drift is
        measured and means something (a model with language)."""
        if not self.cfg.watch.enabled:
            return
        drift = bool(self.cfg.kl_coef) or self.cfg.measure_drift
        drift = drift and model_defaults(self.shared.model).has_language
        self.watch = ServedWatch.resume(self.cfg.watch, store, state, drift=drift, whose=self.whose)

    # -- decisions --------------------------------------------------------------------------

    async def before_update(self, policy: Policy, serving_version: int) -> None:
        """Let the gate draw a new probe set while `policy` still holds the serving weights."""
        if self.gate is not None:
            await self.gate.refresh(policy, serving_version)

    async def after_update(
        self, policy: Policy, version: int, weights: Any, serving_version: int
    ) -> Decision:
        """Serve or refuse `version`, just trained and exported as `weights`."""
        if self.gate is None:
            return self._serve(version, None, None)
        verdict = await self.gate.assess(policy, version, weights)
        probe = verdict.probe
        self.metrics.observe_gate(verdict.accepted, probe)
        if verdict.accepted:
            self.gate.accepted(verdict.on_first_set)
            return self._serve(version, verdict.reason, probe)
        self.rejected += 1
        self.refusals_in_row += 1
        log.warning("v%d%s refused by the promotion gate: %s", version, self.whose, verdict.reason)
        resume = version if self.cfg.gate.on_reject == "continue" else serving_version
        return Decision(Verdict.REFUSE, version, resume, self.lr_scale(),
                        self.protect(resume), verdict.reason, probe)  # fmt: skip

    def _serve(self, version: int, reason: str | None, probe: Any) -> Decision:
        self.refusals_in_row = 0
        return Decision(Verdict.SERVE, version, version, self.lr_scale(),
                        self.protect(version), reason, probe)  # fmt: skip

    async def check_served(self, quality: QualityStore | None) -> Decision | None:
        """Every `check_interval_s`, the watch's look at the live versions' counters: a
        roll-back decision after a clear fall."""
        if self.watch is None or quality is None or time.monotonic() < self._next_watch:
            return None
        self._next_watch = time.monotonic() + self.cfg.watch.check_interval_s
        found = await quality.read(self.watch.wanted(), tenant=self.tenant)
        rollback = self.watch.check({q.version: q for q in found})
        if rollback is None:
            return None
        self.refusals_in_row += 1  # the next update steps more carefully, as after a refusal
        return Decision(
            Verdict.ROLL_BACK,
            rollback.culprit,
            rollback.target,
            self.lr_scale(),
            self.protect(rollback.target),
            rollback.reason,
            rollback=rollback,
        )

    # -- what the loop did --------------------------------------------------------------------

    def went_live(self, version: int) -> None:
        """A served version is announced: the watch will check it."""
        if self.watch is not None:
            self.watch.went_live(version)

    def rolled_back(self, rollback: Rollback, new_version: int) -> None:
        """`rollback.target`'s weights are live again as `new_version`."""
        assert self.watch is not None
        self.watch.rolled_back(new_version)
        if self.gate is not None:
            self.gate.serve_again(rollback.target)
        self.metrics.rollbacks.inc()

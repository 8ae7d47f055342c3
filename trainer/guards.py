"""What stands between a trained version and its users: the promotion gate and the watch.

The trainer owns one `Safeguards`. Before a version is announced, `judge()` has the
promotion gate (`liveloop.trainer.gate`) probe its weights and decide; between updates,
`check_served()` has the served-quality watch (`liveloop.trainer.watch`) compare the live
versions' served reward and reference NLL, and returns a `Rollback` after a clear fall. Both
make the next update step more carefully (`lr_scale()`), so a run that is going wrong slows
down instead of repeating its mistake. Carrying out a rollback (reverting the weights,
saving and publishing them again) needs the trainer's state and stays in the training loop.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from liveloop.config import JudgeConfig, SharedSettings, TrainerConfig
from liveloop.config.defaults import model_defaults
from liveloop.quality import QualityStore
from liveloop.trainer.checkpoints import CheckpointStore, TrainerState
from liveloop.trainer.gate import GateVerdict, PromotionGate, build_panel
from liveloop.trainer.metrics import TrainerMetrics
from liveloop.trainer.watch import Rollback, ServedWatch

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
    ) -> None:
        self.cfg = cfg
        self.shared = shared
        self.judging = judging
        self.metrics = metrics
        self.gate: PromotionGate | None = None
        self.watch: ServedWatch | None = None
        self.rejected = 0
        self.refusals_in_row = 0  # refusals (and rollbacks) since the last accepted version
        self._next_watch = 0.0  # monotonic time of the watch's next look at served counters

    @property
    def gated(self) -> bool:
        """True when new versions pass the promotion gate before they are announced."""
        return self.cfg.gate.enabled

    def lr_scale(self) -> float:
        """Learning-rate factor of the next update: smaller after each refusal in a row."""
        gate = self.cfg.gate
        return max(gate.reject_lr_scale**self.refusals_in_row, gate.min_lr_scale)

    async def start_gate(self, policy: Policy, serving_version: int) -> PromotionGate | None:
        """Probe version 0 and the serving version once, before the first update."""
        if not self.gated:
            return None
        panel = build_panel(self.judging, self.shared)
        self.gate = PromotionGate(self.shared.model, self.cfg.gate, panel)
        await self.gate.start(policy, serving_version)
        return self.gate

    def start_watch(self, store: CheckpointStore, state: TrainerState) -> None:
        """The watch (if enabled), with the reference-NLL bound where served drift is
        measured and means something (a model with language)."""
        if not self.cfg.watch.enabled:
            return
        drift = bool(self.cfg.kl_coef) or self.cfg.measure_drift
        drift = drift and model_defaults(self.shared.model).has_language
        self.watch = ServedWatch.resume(self.cfg.watch, store, state, drift=drift)

    async def judge(self, policy: Policy, version: int, weights: Any) -> GateVerdict | None:
        """The promotion gate's verdict on `version`, just trained and exported as `weights`
        (None: no gate)."""
        if self.gate is None:
            return None
        probe = await self.gate.probe(policy, version, weights)
        verdict = self.gate.decide(probe)
        self.metrics.observe_gate(verdict.accepted, probe)
        if verdict.accepted:
            self.gate.accepted(probe)
            self.refusals_in_row = 0
        else:
            self.rejected += 1
            self.refusals_in_row += 1
            log.warning("v%d refused by the promotion gate: %s", version, verdict.reason)
        return verdict

    def went_live(self, version: int) -> None:
        """A new version is being served: the watch will check it."""
        if self.watch is not None:
            self.watch.went_live(version)

    def keep(self) -> frozenset[int]:
        """Checkpoints the watch may need: the good versions and the next ones to check."""
        return self.watch.keep() if self.watch is not None else frozenset()

    def awaiting(self) -> frozenset[int]:
        """Live versions the watch has yet to judge."""
        return frozenset(self.watch.pending) if self.watch is not None else frozenset()

    async def check_served(self, quality: QualityStore | None) -> Rollback | None:
        """Every `check_interval_s`, the watch's look at the live versions' counters."""
        if self.watch is None or quality is None or time.monotonic() < self._next_watch:
            return None
        self._next_watch = time.monotonic() + self.cfg.watch.check_interval_s
        found = await quality.read(self.watch.wanted())
        return self.watch.check({q.version: q for q in found})

    def rolled_back(self, rollback: Rollback, new_version: int) -> None:
        """`rollback.target`'s weights are live again as `new_version`."""
        assert self.watch is not None
        self.watch.rolled_back(new_version)
        if self.gate is not None:
            self.gate.serve_again(rollback.target)
        self.refusals_in_row += 1  # the next update steps more carefully, as after a refusal
        self.metrics.rollbacks.inc()

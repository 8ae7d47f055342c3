"""`opd`: hindsight-guided on-policy distillation, a teacher's view of each sampled token.

A judge's directive hint ("two sentences at most") says how a reply should have been
different. For a hinted turn, the teacher scores every token the policy sampled after the
turn's own prompt with the hint inserted (`liveloop.trainer.opd`); the token's advantage is

    A_t = opd_weight * clip(log pi_teacher(a_t | s + hint) - log pi_proximal(a_t | s))

or, with `trainer.opd.advantage = "contrastive"`, the hint's own effect on the teacher,

    A_t = opd_weight * clip(log pi_teacher(a_t | s + hint) - log pi_teacher(a_t | s))

(the teacher's two log-probs are subtracted before the update: the prepared signal), each
optionally centred on its reply's mean. Only hinted turns are trained; `combine` adds the
reward. The arithmetic is `distillation_advantages`, pure and checkable by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from liveloop.config.opd import OPDSettings
from liveloop.config.trainer import TrainerConfig
from liveloop.contracts import BatchSample
from liveloop.trainer.objectives.base import (
    Needs,
    Objective,
    ObjectiveContext,
    ObjectiveReport,
    Tally,
    TokenInputs,
    TokenSignal,
)
from liveloop.trainer.opd.distill import SKIP_REASONS, Distiller, make_teacher

if TYPE_CHECKING:
    import torch

_SUMS = ("hinted", "opd_samples", "opd_tokens", "opd_adv", "gap_before", "gap_after",
         "contrast", *(f"skip_{reason}" for reason in SKIP_REASONS))  # fmt: skip


def opd_advantages(
    teacher: torch.Tensor,
    proximal: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
    lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """log pi_teacher - log pi_proximal per token (clamped to +-clip), 0 where `mask` is 0.

    With `lengths` (completion tokens of each reply, in row order), each reply's taught
    tokens are centred on their own mean: a baseline per reply, which leaves the expected
    gradient as it is but drops the push on every sampled token at once that a teacher
    surprised by the whole reply gives (it raises the student's entropy).
    """
    import torch

    gap = (teacher - proximal).detach()
    if clip is not None:
        gap = gap.clamp(-clip, clip)
    gap = gap * mask
    if lengths is None:
        return gap
    parts = []
    for g, m in zip(gap.split(list(lengths)), mask.split(list(lengths)), strict=True):
        taught = m.sum()
        parts.append(g - m * (g.sum() / taught) if taught > 0 else g)
    return torch.cat(parts) if parts else gap


def distillation_advantages(tokens: TokenInputs, cfg: OPDSettings) -> torch.Tensor:
    """`opd_weight` x the OPD advantage of each token (centred per reply when configured):
    the prepared teacher log-prob minus the proximal one, or, contrastive, the prepared
    difference of the teacher's two log-probs as it is."""
    import torch

    lengths = tokens.lengths if cfg.center_advantages else None
    base = tokens.proximal if cfg.advantage == "plain" else torch.zeros_like(tokens.proximal)
    gap = opd_advantages(tokens.signal, base, tokens.signal_mask, cfg.advantage_clip, lengths)
    return cfg.opd_weight * gap


class OPDObjective(Objective):
    """Distillation only: hinted turns, taught by the teacher of `trainer.opd`."""

    name = "opd"

    def __init__(self, context: ObjectiveContext) -> None:
        super().__init__(context)
        trainer = context.trainer
        self.cfg = trainer.opd
        teacher = make_teacher(
            self.cfg, context.policy, trainer.micro_batch_tokens, trainer.device,
            context.model_name or "default", context.cache,
        )  # fmt: skip
        self.distiller = Distiller(self.cfg, context.policy, teacher, context.tool_result_reminder)
        self.tally = Tally(_SUMS, maxima=("seconds",))
        self._seconds = 0.0  # teacher time of this rank in the current update

    @classmethod
    def needs(cls, cfg: TrainerConfig) -> Needs:
        """The reference weights when they are the teacher."""
        return Needs(reference=cfg.opd.teacher == "reference")

    def rejects(self, sample: BatchSample) -> str | None:
        """A turn without a directive hint has nothing to distil."""
        return "no_hint" if sample.hint is None else None

    def prepare(self, samples: list[BatchSample]) -> TokenSignal:
        """The teacher's log-probs of every hinted sample that fits the budgets."""
        signal = self.distiller.signal(samples)
        self.tally.add("hinted", signal.hinted)
        self.tally.add("opd_samples", len(signal.logprobs))
        for reason, count in signal.skipped.items():
            self.tally.add(f"skip_{reason}", count)
        self._seconds = signal.seconds
        return signal.logprobs

    def advantages(self, tokens: TokenInputs) -> torch.Tensor:
        """The distillation advantage, with its statistics tallied."""
        opd = distillation_advantages(tokens, self.cfg)
        self._tally_taught(tokens, opd)
        return opd

    def _tally_taught(self, tokens: TokenInputs, opd: torch.Tensor) -> None:
        self.tally.add("opd_tokens", float(tokens.signal_mask.sum()))
        self.tally.add("opd_adv", float(opd.sum()))
        if self.cfg.advantage == "contrastive":  # the signal is the hint's effect itself
            self.tally.add("contrast", float((tokens.signal * tokens.signal_mask).sum()))
            return
        gap = (tokens.proximal.detach() - tokens.signal).abs() * tokens.signal_mask
        self.tally.add("gap_before", float(gap.sum()))

    def after_steps(self, samples: list[BatchSample], signal: TokenSignal) -> None:
        """The student's gap to the teacher on the taught tokens again, after the steps."""
        import time

        import torch

        from liveloop.trainer.data import micro_batches
        from liveloop.trainer.policy import completion_logprobs

        taught = [s for s in samples if s.key in signal]
        if self.cfg.measure_gap_after and self.cfg.advantage == "plain" and taught:
            start, trainer = time.perf_counter(), self.context.trainer
            batches = micro_batches(
                taught, trainer.micro_batch_tokens, trainer.device, signal,
                share=trainer.share_prefixes,
            )  # fmt: skip
            with torch.no_grad():
                for mb in batches:
                    after = completion_logprobs(self.context.policy.model, mb)[0]
                    gap = (after - mb.signal).abs() * mb.signal_mask
                    self.tally.add("gap_after", float(gap.sum()))
            self._seconds += time.perf_counter() - start
        self.tally.peak("seconds", self._seconds)

    def report(self, sums: dict[str, float], maxima: dict[str, float]) -> ObjectiveReport:
        """Taught samples, mean advantage, the teacher-student gap before and after, time."""
        tokens = max(sums["opd_tokens"], 1.0)
        metrics = {
            "opd_samples": sums["opd_samples"],
            "opd_advantage": sums["opd_adv"] / tokens,
            "opd_seconds": maxima["seconds"],
        }
        for reason in SKIP_REASONS:
            if sums[f"skip_{reason}"] > 0:
                metrics[f"opd_skipped_{reason}"] = sums[f"skip_{reason}"]
        taught = f"opd: {sums['opd_samples']:.0f}/{sums['hinted']:.0f} hinted taught"
        if self.cfg.advantage == "contrastive":
            metrics["opd_contrast"] = sums["contrast"] / tokens
            note = f"{taught}, hint effect {metrics['opd_contrast']:+.3f}"
        else:
            metrics["opd_gap_before"] = sums["gap_before"] / tokens
            measured = self.cfg.measure_gap_after and sums["opd_samples"] > 0
            if measured:
                metrics["opd_gap_after"] = sums["gap_after"] / tokens
            after = f"{metrics['opd_gap_after']:.3f}" if measured else "-"
            note = f"{taught}, gap {metrics['opd_gap_before']:.3f} -> {after}"
        note = f"{note}, {maxima['seconds']:.1f}s"
        return ObjectiveReport(metrics, note if sums["hinted"] else "")

    def close(self) -> None:
        """Release the teacher."""
        self.distiller.close()

"""The promotion gate's bounds, as the reasons a candidate may not replace the serving version.

Pure comparisons of probe results (`ProbeResult`) measured on the same probes: the reward
margins against the serving version and version 0, and the drift bounds against version 0
(KL and NLL to the reference, and the share bounds, which count only changes beyond paired
sampling noise: `liveloop.trainer.safeguards.shares`). Each function returns the reasons it
found, empty when the candidate is within its bounds.
"""

from __future__ import annotations

from liveloop.config.gate import GateSettings
from liveloop.trainer.safeguards.probing import ProbeResult
from liveloop.trainer.safeguards.shares import Mark, by_more_than, worse_beyond_noise


def reward_reasons(
    cfg: GateSettings, candidate: ProbeResult, version0: ProbeResult, serving: ProbeResult
) -> list[str]:
    """Probe reward below the serving version's (and version 0's) by more than the margin."""
    margin, new = cfg.reward_margin, candidate.reward
    bases = [("the serving version's", serving.reward)]
    if cfg.compare_with_version0 and serving.version != 0:
        bases.append(("version 0's", version0.reward))
    return [
        f"probe reward {new:+.3f} is below {name} {base:+.3f} by more than {margin:g}"
        for name, base in bases
        if base is not None and new is not None and by_more_than(base, new, margin)
    ]


def drift_reasons(
    cfg: GateSettings,
    max_kl: float | None,
    has_language: bool,
    candidate: ProbeResult,
    version0: ProbeResult,
) -> list[str]:
    """Drift from the reference, and replies that stopped being answers."""
    reasons: list[str] = []
    if max_kl is not None and candidate.kl_ref > max_kl:
        reasons.append(f"KL to the reference {candidate.kl_ref:.3f} > {max_kl:g}")
    ratio = cfg.max_nll_ratio
    if ratio is not None and candidate.ref_nll > ratio * version0.ref_nll:
        reasons.append(
            f"reference NLL {candidate.ref_nll:.3f} > {ratio:g} x version 0's "
            f"{version0.ref_nll:.3f}"
        )
    drop, before, now = cfg.max_sense_drop, version0.sense_rate, candidate.sense_rate
    if _share_lost(cfg, version0, candidate, "sensible", drop, before, now, good=True):
        reasons.append(
            f"the sense judge read {now:.0%} of replies as sensible answers, below version "
            f"0's {before:.0%} by more than {drop:.0%}"
        )
    if not has_language:
        return reasons
    drop, before, now = cfg.max_topic_drop, version0.topic_rate, candidate.topic_rate
    if _share_lost(cfg, version0, candidate, "on_topic", drop, before, now, good=True):
        reasons.append(
            f"topic rate {now:.0%} is below version 0's {before:.0%} by more than {drop:.0%}"
        )
    symbols = cfg.max_symbol_share
    if symbols is not None and candidate.symbol_share > symbols:
        reasons.append(
            f"{candidate.symbol_share:.0%} of replies dominated by symbols > {symbols:.0%}"
        )
    rise, before, now = (
        cfg.max_nonsense_rise,
        version0.nonsense_share,
        candidate.nonsense_share,
    )
    if _share_lost(cfg, version0, candidate, "no_answer", rise, before, now, good=False):
        reasons.append(
            f"{now:.0%} of replies are no answer (nonsense, word salad, "
            f"repeats), above version 0's {before:.0%} by more than {rise:.0%}"
        )
    return reasons


def _share_lost(
    cfg: GateSettings,
    version0: ProbeResult,
    candidate: ProbeResult,
    mark: Mark,
    bound: float | None,
    before: float | None,
    now: float | None,
    *,
    good: bool,
) -> bool:
    """Whether a share (of replies whose `mark` is `good`, or not `good` for a share of bad
    replies) got worse than version 0's by more than `bound` and beyond paired sampling
    noise (`loss_z`); never where the bound is unset or either share unmeasured."""
    if bound is None or before is None or now is None:
        return False
    high, low = (before, now) if good else (now, before)
    return by_more_than(high, low, bound) and worse_beyond_noise(
        version0, candidate, mark, good=good, z=cfg.loss_z
    )

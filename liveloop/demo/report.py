"""The demo report: reward per policy version and over time, together with reply quality.

Reads the judged turns from `liveloop:scored` (what the judging loop really produced), so
the curve shows what the platform learned, not what the simulated users intended. Beside
the reward, every version gets the quality measures that tell learning from decay: topic
rate, symbol-dominated and non-answer shares and words of its replies (`measures`), and,
from the registry, the platform's own per-version figures (reference NLL and KL on served
tokens, distinct-2, unscored share) and the promotion gate's probe results. The headline
states the reward gain together with quality (`render` writes it out).
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from liveloop import bus
from liveloop.contracts import ScoredTurn, WeightsAnnouncement
from liveloop.demo.curves import gain_standard_error, turns_to_threshold, window_means
from liveloop.demo.measures import reply_quality
from liveloop.demo.render import plot, render_markdown
from liveloop.registry import Registry, RegistryError

# Quality bounds the final version must keep relative to version 0 (the demo's targets).
TOPIC_RATE_SLACK = 0.05
MAX_NLL_RATIO = 1.25
MAX_SYMBOL_SHARE = 0.02
NON_ANSWER_SLACK = 0.05  # the final version may give this many more non-answers than version 0
SENSE_SLACK = 0.1  # and this much smaller a share of replies the sense judge reads as sensible
# A topic, non-answer or sense loss must also exceed sampling noise: the two shares come from a few
# dozen replies sampled at temperature 1, so the same weights measured twice often differ by
# more than the slack. One-sided 5%: a loss beyond 1.645 standard errors of the difference.
LOSS_Z = 1.645


@dataclass
class JudgedTurn:
    """The parts of a scored turn the report needs."""

    score: float
    version: int
    tokens: int
    words: int
    judged_at: float
    turn_type: str
    signal: str = "next_turn"  # what it was judged on: next_turn, feedback or timeout
    question: str = ""
    reply: str = ""
    hint: str | None = None  # the judge's directive hint, if any
    messages: list[dict[str, Any]] | None = None  # the request (kept for hinted turns only)
    tools: list[dict[str, Any]] | None = None
    tenant: str = ""  # the API key id it was served to
    adapter: str | None = None  # the LoRA adapter that served it (None: the base weights)
    key: str = ""  # session, turn and sample: what a batch sample names it by


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user" and isinstance(message.get("content"), str):
            return str(message["content"])
    return ""


def read_judged(redis_url: str) -> list[JudgedTurn]:
    """Every judged main turn in stream order."""
    client = bus.redis_client_sync(redis_url)
    out: list[JudgedTurn] = []
    try:
        last = "-"
        while True:
            batch: Any = client.xrange(bus.stream_key(bus.SCORED), min=last, count=1000)
            batch = [e for e in batch if e[0] != last]
            if not batch:
                break
            last = batch[-1][0]
            for turn in bus.decode_entries(batch, ScoredTurn):
                content = turn.response.get("content") or ""
                hint = turn.directive_hint
                out.append(
                    JudgedTurn(
                        score=turn.score,
                        version=turn.min_version,
                        tokens=len(turn.completion_token_ids),
                        words=len(str(content).split()),
                        judged_at=turn.judged_at,
                        turn_type=turn.turn_type,
                        signal=turn.signal,
                        question=_last_user_text(turn.messages),
                        reply=str(content),
                        hint=hint,
                        messages=turn.messages if hint else None,
                        tools=turn.tools if hint else None,
                        tenant=turn.tenant,
                        adapter=turn.adapter,
                        key=turn.key,
                    )
                )
    finally:
        client.close()
    return [t for t in out if t.turn_type == "main"]


def read_update_metrics(redis_url: str) -> list[dict[str, float]]:
    """Every update's statistics, as announced on `liveloop:weights` (pruned versions too)."""
    client = bus.redis_client_sync(redis_url)
    try:
        entries: Any = client.xrange(bus.stream_key(bus.WEIGHTS))
    finally:
        client.close()
    return [a.metrics for a in bus.decode_entries(entries, WeightsAnnouncement)]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarise(
    turns: list[JudgedTurn], window: int, threshold: float | None = None
) -> dict[str, Any]:
    """Reward and reply quality per version, first/last window, and the curve over turns."""
    by_version: dict[int, list[JudgedTurn]] = defaultdict(list)
    for t in turns:
        by_version[t.version].append(t)
    per_version = {
        str(v): {
            "turns": len(ts),
            "mean_reward": _mean([t.score for t in ts]),
            "mean_completion_tokens": _mean([float(t.tokens) for t in ts]),
            **reply_quality((t.question, t.reply) for t in ts),
        }
        for v, ts in sorted(by_version.items())
    }
    window = max(1, min(window, len(turns) // 2)) if turns else window
    first, last = turns[:window], turns[-window:]
    summary: dict[str, Any] = {
        "judged_turns": len(turns),
        "window_turns": window,
        "reward_first_window": _mean([t.score for t in first]),
        "reward_last_window": _mean([t.score for t in last]),
        "quality_first_window": reply_quality((t.question, t.reply) for t in first),
        "quality_last_window": reply_quality((t.question, t.reply) for t in last),
        "policy_versions": len(by_version),
        "final_version": max(by_version) if by_version else 0,
        "per_version": per_version,
        "hint_share": _mean([float(t.hint is not None) for t in turns]),
        "judged_on": dict(Counter(t.signal for t in turns)),
        "reward_per_window": window_means([t.score for t in turns], window),
    }
    if threshold is not None:
        summary["threshold"] = threshold
        summary["turns_to_threshold"] = turns_to_threshold(
            [t.score for t in turns], threshold, window
        )
    if summary["reward_first_window"] is not None and summary["reward_last_window"] is not None:
        summary["improvement"] = summary["reward_last_window"] - summary["reward_first_window"]
        summary["improvement_se"] = gain_standard_error(
            [t.score for t in first], [t.score for t in last]
        )
    return summary


def add_registry_quality(summary: dict[str, Any], db_url: str) -> None:
    """Per-version figures the platform stored: served-traffic quality, probes, refusals."""
    try:
        with Registry.open(db_url) as registry:
            stored = registry.version_quality()
            versions = registry.list_model_versions(limit=10_000)
    except RegistryError:
        return
    platform: dict[str, Any] = {}
    for row in stored:
        probe = row.probe or {}
        platform[str(row.version)] = {
            "served": row.served,
            "probe": row.probe,
            "status": probe.get("status") or ("base" if row.version == 0 else None),
            "reason": probe.get("reason"),
        }
    for info in versions:
        entry = platform.setdefault(str(info.version), {})
        entry.update(status=info.status, reason=info.reason)
    summary["platform"] = dict(sorted(platform.items(), key=lambda kv: int(kv[0])))
    for status in ("rejected", "rolled_back"):
        summary[f"{status}_versions"] = sorted(
            int(v) for v, entry in platform.items() if entry.get("status") == status
        )


TRAINING_MEANS = ("seconds", "hint_share", "opd_samples", "opd_advantage", "opd_seconds")
# What each update's row keeps, to follow a run version by version (entropy, drift, OPD).
PER_UPDATE = ("entropy", "ref_kl", "approx_kl", "loss", "samples", "reward_mean", "opd_advantage",
              "opd_contrast", "opd_gap_before", "opd_gap_after", "opd_seconds")  # fmt: skip


def training_figures(per_update: list[dict[str, float]]) -> dict[str, Any]:
    """What the updates did on average: update time, hint share, the OPD teacher's cost and
    the teacher-student gap before and after (over updates that taught something)."""
    updates = [m for m in per_update if "seconds" in m]
    out: dict[str, Any] = {"updates": len(updates)}
    for key in TRAINING_MEANS:
        out[key] = _mean([m[key] for m in updates if key in m])
    taught = [m for m in updates if m.get("opd_samples")]
    out["updates_with_opd"] = len(taught)
    out["opd_gap_before"] = _mean([m["opd_gap_before"] for m in taught if "opd_gap_before" in m])
    out["opd_gap_after"] = _mean([m["opd_gap_after"] for m in taught if "opd_gap_after" in m])
    skipped: dict[str, float] = defaultdict(float)
    for m in updates:
        for key, value in m.items():
            if key.startswith("opd_skipped_"):
                skipped[key.removeprefix("opd_skipped_")] += value
    out["opd_skipped"] = dict(skipped)
    out["per_update"] = [{k: m[k] for k in PER_UPDATE if k in m} for m in updates]
    return out


def headline(summary: dict[str, Any]) -> dict[str, Any]:
    """Improvement together with quality: the final version against version 0."""
    evals = summary.get("eval") or {}
    base = evals.get("version 0") or {}
    final = next((row for name, row in evals.items() if "final" in name), base)
    platform = summary.get("platform") or {}
    v0_probe = (platform.get("0") or {}).get("probe") or {}
    probed = [
        int(v)
        for v, e in platform.items()
        if e.get("probe") and e.get("status") not in ("rejected", "rolled_back")
    ]
    final_version = max(probed, default=0)
    final_probe = (platform.get(str(final_version)) or {}).get("probe") or {}
    out: dict[str, Any] = {
        "reward_gain": summary.get("improvement"),
        "reward_gain_se": summary.get("improvement_se"),
        "held_out_reward": {
            "version 0": base.get("mean_reward"),
            "final": final.get("mean_reward"),
        },
        "topic_rate": {"version 0": base.get("topic_rate"), "final": final.get("topic_rate")},
        "symbol_share_final": final.get("symbol_share"),
        "non_answer_share": {
            "version 0": base.get("non_answer_share"),
            "final": final.get("non_answer_share"),
        },
        "ref_nll": {"version 0": v0_probe.get("ref_nll"), "final": final_probe.get("ref_nll")},
        "sense_rate": {"version 0": base.get("sense_rate"), "final": final.get("sense_rate")},
        "tool_call_rate": {
            "version 0": base.get("tool_probe"),
            "final": final.get("tool_probe"),
        },
        "final_probed_version": final_version,
    }
    checks: dict[str, bool | None] = {
        "topic_rate": None, "ref_nll": None, "symbols": None, "non_answers": None
    }  # fmt: skip
    if base.get("topic_rate") is not None and final.get("topic_rate") is not None:
        checks["topic_rate"] = not _share_lost(
            base, final, "topic_rate", TOPIC_RATE_SLACK, rising=False
        )
    if v0_probe.get("ref_nll") and final_probe.get("ref_nll") is not None:
        out["ref_nll_ratio"] = final_probe["ref_nll"] / v0_probe["ref_nll"]
        checks["ref_nll"] = out["ref_nll_ratio"] <= MAX_NLL_RATIO
    if final.get("symbol_share") is not None:
        checks["symbols"] = _symbols_kept(base.get("symbol_share"), final["symbol_share"])
    if base.get("non_answer_share") is not None and final.get("non_answer_share") is not None:
        checks["non_answers"] = not _share_lost(
            base, final, "non_answer_share", NON_ANSWER_SLACK, rising=True
        )
    if base.get("sense_rate") is not None and final.get("sense_rate") is not None:
        checks["sense"] = not _share_lost(base, final, "sense_rate", SENSE_SLACK, rising=False)
    out["quality_kept"] = checks
    return out


def _symbols_kept(before: float | None, after: float) -> bool:
    """Under `MAX_SYMBOL_SHARE` of the final replies dominated by symbols, or no more of
    them than version 0's: a version is not said to have lost what the base never had."""
    return after < MAX_SYMBOL_SHARE or (before is not None and after <= before)


def _share_lost(
    base: dict[str, Any], final: dict[str, Any], key: str, slack: float, *, rising: bool
) -> bool:
    """Whether the final version's share `key` is worse than version 0's (worse is higher
    when `rising`, lower otherwise) by more than `slack` and, where both say how many replies
    they measured (`turns`), by more than `LOSS_Z` standard errors of the difference of the
    two shares (pooled), so that sampling alone rarely fails the check."""
    before, after = float(base[key]), float(final[key])
    worse = after - before if rising else before - after
    if worse <= slack:
        return False
    n_base, n_final = base.get("turns"), final.get("turns")
    if not n_base or not n_final:
        return True
    pooled = (before * n_base + after * n_final) / (n_base + n_final)
    spread = math.sqrt(pooled * (1 - pooled) * (1 / n_base + 1 / n_final))
    return worse > LOSS_Z * spread


def write_report(
    out_dir: Path,
    summary: dict[str, Any],
    turns: list[JudgedTurn],
    curves: dict[str, list[float]] | None = None,
) -> dict[str, Path]:
    """Write report.json, report.md and reward.png; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "report.json",
        "md": out_dir / "report.md",
        "png": out_dir / "reward.png",
    }
    summary["headline"] = headline(summary)
    paths["json"].write_text(json.dumps(summary, indent=2))
    times = [t.judged_at for t in turns]
    plot([t.score for t in turns], times, summary, paths["png"], curves)
    paths["md"].write_text(render_markdown(summary))
    return paths

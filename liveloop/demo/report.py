"""The demo report: judged reward and response length per policy version and over time.

Reads the judged turns from `liveloop:scored` (what the judging loop really produced),
so the curve shows what the platform learned, not what the simulated users intended.
Writes `report.json`, `report.md` and `reward.png` into `<data-dir>/demo/`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis


@dataclass
class JudgedTurn:
    """The parts of a scored turn the report needs."""

    score: float
    version: int
    tokens: int
    words: int
    judged_at: float
    turn_type: str


def read_judged(redis_url: str) -> list[JudgedTurn]:
    """Every judged main turn in stream order."""
    client: Any = redis.Redis.from_url(redis_url, decode_responses=True)
    out: list[JudgedTurn] = []
    try:
        last = "-"
        while True:
            batch = client.xrange("liveloop:scored", min=last, count=1000)
            batch = [e for e in batch if e[0] != last]
            if not batch:
                break
            for entry_id, fields in batch:
                last = entry_id
                data = json.loads(fields["data"])
                content = (data.get("response") or {}).get("content") or ""
                out.append(
                    JudgedTurn(
                        score=float(data["score"]),
                        version=min(data.get("versions") or [0]),
                        tokens=len(data.get("completion_token_ids") or []),
                        words=len(content.split()),
                        judged_at=float(data.get("judged_at") or 0.0),
                        turn_type=data.get("turn_type", "main"),
                    )
                )
    finally:
        client.close()
    return [t for t in out if t.turn_type == "main"]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarise(turns: list[JudgedTurn], window: int) -> dict[str, Any]:
    """Reward per version, first/last window, and the curve over time."""
    by_version: dict[int, list[JudgedTurn]] = defaultdict(list)
    for t in turns:
        by_version[t.version].append(t)
    per_version = {
        str(v): {
            "turns": len(ts),
            "mean_reward": _mean([t.score for t in ts]),
            "mean_completion_tokens": _mean([float(t.tokens) for t in ts]),
            "mean_words": _mean([float(t.words) for t in ts]),
        }
        for v, ts in sorted(by_version.items())
    }
    window = max(1, min(window, len(turns) // 2)) if turns else window
    first, last = turns[:window], turns[-window:]
    return {
        "judged_turns": len(turns),
        "window_turns": window,
        "reward_first_window": _mean([t.score for t in first]),
        "reward_last_window": _mean([t.score for t in last]),
        "words_first_window": _mean([float(t.words) for t in first]),
        "words_last_window": _mean([float(t.words) for t in last]),
        "policy_versions": len(by_version),
        "final_version": max(by_version) if by_version else 0,
        "per_version": per_version,
    }


def plot(turns: list[JudgedTurn], summary: dict[str, Any], path: Path) -> None:
    """Reward and response length per version and over time, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    versions = [int(v) for v in summary["per_version"]]
    rewards = [summary["per_version"][str(v)]["mean_reward"] for v in versions]
    words = [summary["per_version"][str(v)]["mean_words"] for v in versions]
    ax = axes[0]
    ax.plot(versions, rewards, "o-", color="tab:blue", label="mean judged reward")
    ax.set_xlabel("policy version")
    ax.set_ylabel("reward", color="tab:blue")
    ax.set_ylim(-1.05, 1.05)
    ax2 = ax.twinx()
    ax2.plot(versions, words, "s--", color="tab:orange", label="mean words")
    ax2.set_ylabel("response words", color="tab:orange")
    ax.set_title("per policy version")
    k = max(1, summary["window_turns"] // 2)
    t0 = turns[0].judged_at if turns else 0.0
    xs = [(t.judged_at - t0) / 60 for t in turns]
    rolling = [
        _mean([t.score for t in turns[max(0, i - k + 1) : i + 1]]) or 0.0 for i in range(len(turns))
    ]
    axes[1].plot(xs, rolling, color="tab:blue", label=f"reward, moving mean of {k}")
    axes[1].set_xlabel("minutes")
    axes[1].set_ylim(-1.05, 1.05)
    axes[1].set_title("over time")
    axes[1].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(
    out_dir: Path, summary: dict[str, Any], turns: list[JudgedTurn]
) -> dict[str, Path]:
    """Write report.json, report.md and reward.png; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "report.json",
        "md": out_dir / "report.md",
        "png": out_dir / "reward.png",
    }
    paths["json"].write_text(json.dumps(summary, indent=2))
    plot(turns, summary, paths["png"])
    paths["md"].write_text(render_markdown(summary))
    return paths


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:+.3f}"


def render_markdown(summary: dict[str, Any]) -> str:
    """A human-readable report."""
    lines = [
        "# LiveLoop demo report",
        "",
        f"Model: `{summary.get('model', '?')}`; {summary.get('minutes', '?')} minutes; "
        f"{summary['judged_turns']} judged turns; {summary['policy_versions']} policy versions.",
        "",
        f"- mean judged reward, first {summary['window_turns']} turns: {_fmt(summary['reward_first_window'])}",
        f"- mean judged reward, last {summary['window_turns']} turns: {_fmt(summary['reward_last_window'])}",
        f"- improvement: {_fmt(summary.get('improvement'))}",
        "",
        "![reward](reward.png)",
        "",
        "| version | judged turns | mean reward | mean words | mean tokens |",
        "|---|---|---|---|---|",
    ]
    for v, row in summary["per_version"].items():
        lines.append(
            f"| {v} | {row['turns']} | {_fmt(row['mean_reward'])} | "
            f"{row['mean_words']:.1f} | {row['mean_completion_tokens']:.1f} |"
        )
    if summary.get("eval"):
        lines += [
            "",
            "## Held-out users (not recorded)",
            "",
            "| version | turns | mean reward |",
            "|---|---|---|",
        ]
        for name, row in summary["eval"].items():
            lines.append(f"| {name} | {row['turns']} | {_fmt(row['mean_reward'])} |")
    return "\n".join(lines) + "\n"

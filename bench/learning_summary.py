"""What `bench/learning.py` writes besides the runs themselves: where a result came from, the
spread of each figure over seeds, one arm against another, and the merge of results run in
separate sittings (`--merge`)."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def provenance() -> dict[str, Any]:
    """When, from which commit, on what machine, by which command."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "command": " ".join(["python", *(relative(a) for a in sys.argv)]),
    }


def relative(arg: str) -> str:
    """A path argument as written from the repository root (no machine's paths in results)."""
    path = Path(arg)
    if path.is_absolute() and path.is_relative_to(ROOT):
        return str(path.relative_to(ROOT))
    return path.name if path.is_absolute() else arg


def spread(values: list[float | None]) -> dict[str, Any]:
    """Mean, standard deviation, the mean's standard error (`std` over the square root of
    `n`: how far the mean of this many runs may sit from the mean of many more), min and max
    of the values that exist."""
    given = [v for v in values if v is not None]
    if not given:
        return {"n": 0, "missing": len(values)}
    std = statistics.stdev(given) if len(given) > 1 else 0.0
    return {
        "n": len(given),
        "missing": len(values) - len(given),
        "mean": statistics.fmean(given),
        "std": std,
        "mean_se": std / math.sqrt(len(given)),
        "min": min(given),
        "max": max(given),
    }


def _last_tool_rate(run: dict[str, Any]) -> float | None:
    """The share of weather questions whose first reply was a tool call, in the last version
    that got any (in results written before commit 0c02393: the share of weather answers
    that came after a call)."""
    by_version = run.get("tool_use") or {}
    if not by_version:
        return None
    last = max(by_version, key=int)
    rate = by_version[last]["tool_call_rate"]
    return float(rate) if rate is not None else None


def aggregate(runs: list[dict[str, Any]], budget: int) -> dict[str, Any]:
    """Per arm: spread over seeds of each figure (unreached threshold = the budget)."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == name]
        reached = [r["turns_to_threshold"] for r in mine]
        training = [r.get("training") or {} for r in mine]
        out[name] = {
            "objective": mine[0]["objective"],
            "opd": mine[0]["opd"],
            "seeds": [r["seed"] for r in mine],
            "last_version_tool_call_rate": spread([_last_tool_rate(r) for r in mine]),
            "turns_to_threshold": spread(reached),
            "turns_to_threshold_capped": spread([t or budget for t in reached]),
            "improvement": spread([r["improvement"] for r in mine]),
            "reward_last_window": spread([r["reward_last_window"] for r in mine]),
            "held_out_reward": spread([r["held_out_reward"] for r in mine]),
            "hint_share": spread([r["hint_share"] for r in mine]),
            "versions_refused": spread([len(r.get("rejected_versions") or []) for r in mine]),
            "update_seconds": spread([t.get("seconds") for t in training]),
            "opd_seconds_per_update": spread([t.get("opd_seconds") for t in training]),
            "held_out_quality": {
                k: spread([(r["held_out_quality"] or {}).get(k) for r in mine])
                for k in ("topic_rate", "symbol_share", "non_answer_share", "mean_words")
            },
        }
    return out


def compare(per_objective: dict[str, Any], a: str = "combine", b: str = "rl") -> dict[str, Any]:
    """`a` against `b` in judged turns to the threshold (unreached counted as the budget)."""
    if a not in per_objective or b not in per_objective:
        return {}
    ta = per_objective[a]["turns_to_threshold_capped"]
    tb = per_objective[b]["turns_to_threshold_capped"]
    if not ta.get("n") or not tb.get("n"):
        return {}
    fewer = tb["mean"] - ta["mean"]
    noise = max(ta["std"], tb["std"])
    return {
        f"{a}_fewer_turns_than_{b}": fewer,
        "spread": noise,
        "verdict": "met" if fewer > noise else "not met",
    }


SAME_IN_MERGED = ("turns", "window", "threshold", "users", "pace", "gate", "preset", "minutes_cap")
"""Arguments that define a comparison: files merged with `--merge` must agree on them."""


def model_summary(runs: list[dict[str, Any]], budget: int, a: str, b: str) -> dict[str, Any]:
    """One model's runs, their per-arm spread and arm `a` against arm `b`."""
    per = aggregate(runs, budget)
    return {"runs": runs, "per_arm": per, f"{a}_vs_{b}": compare(per, a, b)}


def merge_results(paths: list[Path], compare_arms: str | None) -> dict[str, Any]:
    """One result from several files of the same comparison (e.g. seeds run on other days)."""
    loaded = [json.loads(p.read_text()) for p in paths]
    first = loaded[0]["args"]
    for path, other in zip(paths[1:], loaded[1:], strict=True):
        differ = [k for k in SAME_IN_MERGED if other["args"].get(k) != first.get(k)]
        if differ:
            raise SystemExit(f"{path.name}: not the same comparison (differs in {differ})")
    models: dict[str, Any] = {}
    for data in loaded:
        for model, found in data["models"].items():
            runs = models.setdefault(model, [])
            for run in found["runs"]:
                for r in (r for r in runs if r["arm"] == run["arm"]):
                    if r["seed"] == run["seed"]:
                        raise SystemExit(f"{model}: arm {run['arm']} seed {run['seed']} twice")
                    if (r["objective"], r["opd"]) != (run["objective"], run["opd"]):
                        raise SystemExit(f"{model}: arm {run['arm']} is not the same arm in each")
                runs.append(run)
    pair_text = compare_arms or (first.get("compare") if first.get("compare") != "None" else None)
    a, b = pair_text.split(",") if pair_text else (None, None)
    merged: dict[str, Any] = {
        **provenance(),
        "merged_from": [
            {"file": p.name, **{k: d.get(k) for k in ("date", "commit", "command")}}
            for p, d in zip(paths, loaded, strict=True)
        ],
        "args": first,
        "models": {},
    }
    for model, runs in models.items():
        names = list(dict.fromkeys(r["arm"] for r in runs))
        pair = (a, b) if a and b else (names[-1], names[0])
        merged["models"][model] = model_summary(runs, int(first["turns"]), *pair)
    return merged

"""How fast the platform learns, per training objective: rl, opd and combine, end to end.

Prints one JSON object. Every run is the real thing: `liveloop demo`'s machinery starts the
four loops (server, judge, collector, trainer) on an embedded Valkey, and a population of
simulated users talks to the server until the judge has scored `--turns` turns; then
training stops and held-out users (a different seed, not recorded) talk to version 0 and
to the final version. Runs differ only in `trainer.objective`; for one model and one seed
they share the same users (population, preferences and questions), the same judged-turn
budget and the same settings otherwise.

By default the users are paced (`--pace 16`): before each request they wait while the judged
turns number 16 x (published versions + 1) or more, so every objective gets one update per
16 judged turns however long its updates take, and the comparison is one of learning per
judged turn, not of trainer speed on a busy machine. `--pace 0` lets them run free.

For every run: the mean judged reward per window of `--window` turns, the number of judged
turns until the moving reward (over `--window` turns) first reaches `--threshold`, the
held-out reward of the final version, the reply-quality measures of the learning-quality
work (topic rate, symbol and non-answer shares, words, distinct-2 of the held-out replies;
reference NLL and KL per version from the registry), the versions the promotion gate
refused, why the users reacted as they did in their first and last answers, the hint share,
and what the teacher cost per update. Per objective: the mean and the spread (standard
deviation, min, max) over seeds; then `combine` against `rl` in judged turns to the
threshold.

`--staleness` also runs `combine` with `max_staleness` 0 against the default, with
free-running users, and reports the wall-clock minutes to the threshold: the end-to-end form of the asynchronous
speed-up that `bench/async_vs_sync.py` measures against a simulated generator.

An arm is an objective with its teacher settings, named: `--arm NAME:OBJECTIVE[:KEY=VALUE...]`
(KEY a field of `trainer.opd`, e.g. `teacher=model`, `teacher_model=qwen2.5-coder-1.5b`,
`advantage=contrastive`); `--objectives rl,combine` is shorthand for arms named after their
objective. The comparison is the second arm against the first (or `--compare A,B`).

Runs take minutes to an hour, so the budget is a flag. Results are also written, as they
come, to `--out` (default: learning.json in the working directory), with the date, the
commit, the machine and the command, so a long sweep can be read while it runs. Seeds run
in separate sittings merge into one summary with `--merge A.json B.json ... --out C.json`
(the files must agree on the budget, window, pace, threshold, users, gate, preset and
minutes cap, an arm's name must mean the same objective and teacher settings in each, and a
seed of an arm may appear once).

    python bench/learning.py --models tiny-random --seeds 0,1,2 --turns 400
    python bench/learning.py --models smollm2-135m --seeds 0,1,2 --turns 300 --staleness
    python bench/learning.py --models qwen2.5-coder-0.5b --arm rl:rl \
        --arm big:combine:teacher=model:teacher_model=qwen2.5-coder-1.5b:advantage=contrastive
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(ROOT)

from liveloop.config import load_settings, presets  # noqa: E402
from liveloop.demo.run import objective_figures, run_objective  # noqa: E402
from liveloop.prm.sense import sense_check_factory  # noqa: E402
from liveloop.valkey import free_port_block  # noqa: E402

# Moving reward to reach, per model: about half-way from where version 0 starts to pleasing
# every user (tiny-random's users judge length only; smollm2's want real, on-topic answers).
THRESHOLDS = {"tiny-random": 0.25, "smollm2-135m": 0.25}


@dataclass(frozen=True)
class Arm:
    """One thing compared: an objective and its `trainer.opd` settings, under a name."""

    name: str
    objective: str
    opd: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Arm:
        """`NAME:OBJECTIVE[:KEY=VALUE...]`."""
        name, objective, *pairs = text.split(":")
        opd = dict(p.split("=", 1) for p in pairs)
        return cls(name, objective, opd)

    def env(self) -> dict[str, str]:
        """Its `trainer.opd` settings as the loops' environment."""
        return {f"LIVELOOP_TRAINER__OPD__{k.upper()}": v for k, v in self.opd.items()}


def provenance() -> dict[str, Any]:
    """When, from which commit, on what machine, by which command."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "command": " ".join(["python", *(_relative(a) for a in sys.argv)]),
    }


def _relative(arg: str) -> str:
    """A path argument as written from the repository root (no machine's paths in results)."""
    path = Path(arg)
    if path.is_absolute() and path.is_relative_to(ROOT):
        return str(path.relative_to(ROOT))
    return path.name if path.is_absolute() else arg


def run_one(
    model: str, arm: Arm, seed: int, args: argparse.Namespace, extra_env: dict[str, str]
) -> dict[str, Any]:
    """One end-to-end run; its figures."""
    objective = arm.objective
    threshold = args.threshold if args.threshold is not None else THRESHOLDS.get(model, 0.25)
    files = [presets.demo_preset(model, args.preset)]  # the demo's tuning, as `liveloop demo`
    settings = load_settings(
        files,
        model=model,
        port=free_port_block(),
        demo={
            "minutes": args.minutes_cap,
            "users": args.users,
            "seed": seed,
            "window_turns": args.window,
            "reward_threshold": threshold,
        },
    )
    with tempfile.TemporaryDirectory(prefix="liveloop-learning-") as scratch:
        started = time.monotonic()
        env = {
            "LIVELOOP_TRAINER__GATE__ENABLED": "true" if args.gate == "on" else "false",
            "LIVELOOP_TRAINER__MICRO_BATCH_TOKENS": str(args.micro_batch_tokens),
            **arm.env(),
            **extra_env,
        }
        run = run_objective(
            settings,
            objective,
            Path(scratch) / "run",
            config_files=files,
            quiet=True,
            extra_env=env,
            max_judged_turns=args.turns,
            turns_per_update=args.pace,
            sense=sense_check_factory(settings.trainer.gate.sense),
        )
    figures = objective_figures(run.summary)
    reactions = run.summary.get("reactions") or {}
    figures.update(
        model=model,
        arm=arm.name,
        objective=objective,
        opd=arm.opd,
        seed=seed,
        tool_use=reactions.get("tool_use"),
        served_per_version=_served_per_version(run.summary),
        seconds=time.monotonic() - started,
        platform_quality=_platform_quality(run.summary),
        rejected_versions=run.summary.get("rejected_versions") or [],
        user_reactions=run.summary.get("reactions"),
        extra_env=extra_env,
        scores=[t.score for t in run.turns],  # in judged order: thresholds can be recomputed
    )
    return figures


def _served_per_version(summary: dict[str, Any]) -> dict[str, Any]:
    """Each version's served replies: judged reward, words, reference NLL and KL."""
    keys = ("judged", "mean_reward", "mean_reply_words", "ref_nll", "kl_ref")
    return {
        version: {k: (entry.get("served") or {}).get(k) for k in keys}
        for version, entry in (summary.get("platform") or {}).items()
        if entry.get("served")
    }


def _platform_quality(summary: dict[str, Any]) -> dict[str, Any]:
    """Reference NLL and KL on served tokens of version 0's turns and of the last version's."""
    platform = summary.get("platform") or {}
    served = {int(v): e["served"] for v, e in platform.items() if e.get("served")}
    if not served:
        return {}
    last = max(served)
    keys = ("ref_nll", "kl_ref", "distinct_2", "unscored_share")
    return {
        "version 0": {k: (served.get(0) or {}).get(k) for k in keys},
        f"version {last}": {k: served[last].get(k) for k in keys},
    }


def spread(values: list[float | None]) -> dict[str, Any]:
    """Mean, standard deviation, min and max of the values that exist."""
    given = [v for v in values if v is not None]
    if not given:
        return {"n": 0, "missing": len(values)}
    return {
        "n": len(given),
        "missing": len(values) - len(given),
        "mean": statistics.fmean(given),
        "std": statistics.stdev(given) if len(given) > 1 else 0.0,
        "min": min(given),
        "max": max(given),
    }


def _last_tool_rate(run: dict[str, Any]) -> float | None:
    """The share of weather questions answered after a tool call, by the last version that
    answered any."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny-random")
    parser.add_argument("--objectives", default="rl,opd,combine", help="arms named by objective")
    parser.add_argument(
        "--arm", action="append", help="NAME:OBJECTIVE[:KEY=VALUE...] (repeatable; see above)"
    )
    parser.add_argument("--compare", help="A,B: arm A against arm B (default: 2nd vs 1st)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--turns", type=int, default=400, help="judged turns per run")
    parser.add_argument("--window", type=int, default=32, help="turns per reward window")
    parser.add_argument("--threshold", type=float, help="moving reward to reach (per model)")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--minutes-cap", type=float, default=60.0, help="longest run")
    parser.add_argument(
        "--pace",
        type=int,
        default=16,
        help="users wait while judged turns exceed this many per published version, so every "
        "objective gets one update per PACE judged turns (0: free-running users)",
    )
    parser.add_argument("--gate", choices=("on", "off"), default="on", help="promotion gate")
    parser.add_argument(
        "--preset", help="demo preset (name or .toml) of every run (default: each model's own)"
    )
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=1024,
        help="trainer micro-batch (the loss does not depend on it; peak memory does)",
    )
    parser.add_argument("--staleness", action="store_true", help="also max_staleness 0 vs default")
    parser.add_argument("--staleness-model", help="model of the staleness runs (first --models)")
    parser.add_argument("--out", type=Path, default=Path("learning.json"))
    parser.add_argument("--merge", type=Path, nargs="+", help="merge these results; run nothing")
    args = parser.parse_args()
    if args.merge:
        merged = merge_results(args.merge, args.compare)
        args.out.write_text(json.dumps(merged, indent=2))
        print(json.dumps({m: {k: v for k, v in d.items() if "_vs_" in k}
                          for m, d in merged["models"].items()}, indent=2))  # fmt: skip
        return
    models = [m for m in args.models.split(",") if m]
    arms = [Arm.parse(a) for a in args.arm] if args.arm else [
        Arm(o, o) for o in args.objectives.split(",") if o
    ]  # fmt: skip
    a, b = args.compare.split(",") if args.compare else (arms[-1].name, arms[0].name)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    result: dict[str, Any] = {
        **provenance(),
        "args": {k: _relative(str(v)) for k, v in vars(args).items()},
        "models": {},
    }
    for model in models:
        runs: list[dict[str, Any]] = []
        for seed in seeds:
            for arm in arms:
                runs.append(run_one(model, arm, seed, args, {}))
                result["models"][model] = model_summary(runs, args.turns, a, b)
                args.out.write_text(json.dumps(result, indent=2))
    if args.staleness:
        model = args.staleness_model or models[0]
        winner = next(arm for arm in arms if arm.name == a)
        pairs: dict[str, list[dict[str, Any]]] = {"max_staleness 0": [], "default": []}
        free = argparse.Namespace(**{**vars(args), "pace": 0})  # wall clock: users never wait
        for seed in seeds:
            for label, env in (
                ("max_staleness 0", {"LIVELOOP_MAX_STALENESS": "0"}),
                ("default", {}),
            ):
                pairs[label].append(run_one(model, winner, seed, free, env))
                result["staleness"] = {
                    "model": model,
                    "arm": winner.name,
                    **{
                        label: {
                            "minutes_to_threshold": spread(
                                [r["minutes_to_threshold"] for r in done]
                            ),
                            "turns_to_threshold": spread([r["turns_to_threshold"] for r in done]),
                            "runs": done,
                        }
                        for label, done in pairs.items()
                    },
                }
                args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

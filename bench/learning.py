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

`--staleness` also runs the compared arm (the first of `--compare`, else the last arm) with
`max_staleness` 0 against the default, with free-running users, and reports the wall-clock
minutes to the threshold: the end-to-end form of the asynchronous speed-up that
`bench/async_vs_sync.py` measures against a simulated generator. `--staleness-only` runs
those runs and not the paced ones. `--keep-data DIR` keeps each run's data dir (its Valkey
data, registry and checkpoints) as `DIR/MODEL-ARM-seedN[-stalenessX]`, so the replies it
served can be read afterwards; without it each run's data is removed when it ends.

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
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(ROOT)

from bench.learning_summary import (  # noqa: E402
    merge_results,
    model_summary,
    provenance,
    relative,
    spread,
)
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


def run_one(
    model: str,
    arm: Arm,
    seed: int,
    args: argparse.Namespace,
    extra_env: dict[str, str],
    tag: str = "",
) -> dict[str, Any]:
    """One end-to-end run; its figures. `tag` tells runs of one arm and seed apart."""
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
    with _run_dir(args.keep_data, f"{model}-{arm.name}-seed{seed}{tag}") as scratch:
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


@contextlib.contextmanager
def _run_dir(keep: Path | None, name: str) -> Iterator[Path]:
    """A run's data dir (Valkey's data, the registry, checkpoints): `keep/name`, kept so its
    served replies can be read afterwards, or a temporary one removed after the run."""
    if keep is not None:
        (keep / name).mkdir(parents=True, exist_ok=False)
        yield keep / name
        return
    with tempfile.TemporaryDirectory(prefix="liveloop-learning-") as scratch:
        yield Path(scratch)


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
    parser.add_argument(
        "--staleness-only", action="store_true", help="run only the --staleness runs"
    )
    parser.add_argument(
        "--keep-data", type=Path, help="keep each run's data dir (streams, registry) under this"
    )
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
        "args": {k: relative(str(v)) for k, v in vars(args).items()},
        "models": {},
    }
    for model in [] if args.staleness_only else models:
        runs: list[dict[str, Any]] = []
        for seed in seeds:
            for arm in arms:
                runs.append(run_one(model, arm, seed, args, {}))
                result["models"][model] = model_summary(runs, args.turns, a, b)
                args.out.write_text(json.dumps(result, indent=2))
    if args.staleness or args.staleness_only:
        model = args.staleness_model or models[0]
        winner = next(arm for arm in arms if arm.name == a)
        pairs: dict[str, list[dict[str, Any]]] = {"max_staleness 0": [], "default": []}
        free = argparse.Namespace(**{**vars(args), "pace": 0})  # wall clock: users never wait
        for seed in seeds:
            for label, env, tag in (
                ("max_staleness 0", {"LIVELOOP_MAX_STALENESS": "0"}, "-staleness0"),
                ("default", {}, "-staleness-default"),
            ):
                pairs[label].append(run_one(model, winner, seed, free, env, tag))
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

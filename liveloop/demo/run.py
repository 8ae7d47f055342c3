"""`liveloop demo`: the four loops, simulated users, a report.

The demo starts the four loops on embedded defaults in a fresh run directory, lets a
population of simulated users talk to the server for `--minutes`, then freezes training,
evaluates version 0 and the final version on the same held-out users (not recorded), and
writes the report. With several training objectives (`--objective rl,combine`) it does
that once per objective, with the same users, and the report compares them.
`run_objective` is also what `bench/learning.py` runs. The held-out users, here and in
`liveloop eval --version`, are `liveloop.demo.heldout`.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from liveloop.config import LiveLoopSettings
from liveloop.config.defaults import model_defaults
from liveloop.demo.driving import drive
from liveloop.demo.heldout import compare_versions, wait_ready
from liveloop.demo.measures import user_reactions
from liveloop.demo.preferences import make_population
from liveloop.demo.report import (
    JudgedTurn,
    add_registry_quality,
    headline,
    read_judged,
    read_update_metrics,
    summarise,
    training_figures,
    write_report,
)
from liveloop.demo.sense_judge import gate_env, rate_held_out, sense_judge_server
from liveloop.demo.users import UserRun
from liveloop.sense import SenseCheckFactory
from liveloop.supervisor import Supervisor

log = logging.getLogger(__name__)


def _child_env(settings: LiveLoopSettings, admin_key: str, pace: int) -> dict[str, str]:
    """The loops' environment: this run's admin key, and the collector's batch size when the
    users are paced (a batch holds up to one version's turns), unless set in yours."""
    env = {"LIVELOOP_ADMIN_KEY": admin_key}
    if pace and "LIVELOOP_COLLECTOR__MIN_TURNS" not in os.environ:
        env["LIVELOOP_COLLECTOR__MIN_TURNS"] = str(pace)
    return env


@dataclass
class ObjectiveRun:
    """One run of the loops under one training objective: its report summary and turns."""

    objective: str
    summary: dict[str, Any]
    turns: list[JudgedTurn]
    started_at: float  # wall-clock time the simulated users started


def demo_objectives(settings: LiveLoopSettings) -> list[str]:
    """The objectives the demo runs, in order, without repeats."""
    return list(dict.fromkeys(settings.demo.objectives))


def run_demo(
    settings: LiveLoopSettings,
    *,
    config_files: list[Path] | None = None,
    quiet: bool = False,
    sense: SenseCheckFactory | None = None,
) -> None:
    """The whole demo, one run per objective; prints where the report landed. `sense`
    builds the sense check of `demo.sense_model` (the CLI passes the LLM judge's). With
    `demo.tenants`, the tenants demo instead (`liveloop.demo.tenants`)."""
    if settings.demo.tenants:
        from liveloop.demo.tenants import run_tenant_demo

        run_tenant_demo(settings, config_files=config_files, quiet=quiet)
        return
    out_dir = settings.data_dir / "demo"
    runs = []
    for i, objective in enumerate(demo_objectives(settings)):
        run_dir = out_dir / ("run" if i == 0 else f"run-{objective}")
        runs.append(
            run_objective(
                settings, objective, run_dir, config_files=config_files, quiet=quiet, sense=sense
            )
        )
    summary = runs[0].summary
    summary["objectives"] = {r.objective: objective_figures(r.summary) for r in runs}
    curves = {r.objective: [t.score for t in r.turns] for r in runs}
    paths = write_report(out_dir, summary, runs[0].turns, curves)
    print(f"demo report: {paths['md']}\n             {paths['json']}\n             {paths['png']}")
    for run in runs:
        s = run.summary
        print(
            f"{run.objective}: reward first window {s['reward_first_window']}, last window "
            f"{s['reward_last_window']}; hint share {s.get('hint_share')}; quality: "
            f"{headline(s)['quality_kept']}"
        )


def objective_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """The figures that compare objectives: reward over turns, threshold, held-out, OPD."""
    evals = summary.get("eval") or {}
    final = next((row for name, row in evals.items() if "final" in name), None) or {}
    keys = ("judged_turns", "reward_first_window", "reward_last_window", "improvement",
            "improvement_se",
            "reward_per_window", "threshold", "turns_to_threshold", "hint_share",
            "policy_versions", "training", "wall_seconds", "minutes_to_threshold")  # fmt: skip
    out = {k: summary.get(k) for k in keys}
    out["held_out_reward"] = final.get("mean_reward")
    out["held_out_quality"] = {
        k: final.get(k)
        for k in (
            "topic_rate",
            "symbol_share",
            "non_answer_share",
            "mean_words",
            "distinct_2",
            "sense_rate",
        )
    }
    return out


def run_objective(
    settings: LiveLoopSettings,
    objective: str,
    run_dir: Path,
    *,
    config_files: list[Path] | None = None,
    quiet: bool = False,
    extra_env: dict[str, str] | None = None,
    max_judged_turns: int | None = None,
    turns_per_update: int | None = None,
    sense: SenseCheckFactory | None = None,
) -> ObjectiveRun:
    """The loops under one objective with simulated users, then the held-out comparison.

    Users talk for `demo.minutes`, or until `max_judged_turns` turns were judged. With
    `turns_per_update` (default: `demo.turns_per_update`; 0: free-running) they wait before each request
    while the judged turns outnumber the published versions by that many per version (see
    `Pacer`). With `demo.sense_model`, its judge is served for the run (`sense_judge`).
    """
    shutil.rmtree(run_dir, ignore_errors=True)
    with sense_judge_server(settings, run_dir) as sense_url:
        env = gate_env(settings, sense_url) | (extra_env or {})
        run = _run_loops(settings, objective, run_dir, config_files, quiet, env,
                         max_judged_turns, turns_per_update)  # fmt: skip
        if sense_url is not None and sense is not None:
            rate_held_out(run.summary["eval"], sense_url, None, sense)
    return run


def _run_loops(
    settings: LiveLoopSettings,
    objective: str,
    run_dir: Path,
    config_files: list[Path] | None,
    quiet: bool,
    extra_env: dict[str, str],
    max_judged_turns: int | None,
    turns_per_update: int | None,
) -> ObjectiveRun:
    """The loops and the users of one run, then the held-out comparison (`run_objective`)."""
    from liveloop.models import resolve_model_dir
    from liveloop.status import LiveView

    child = settings.model_copy(update={"data_dir": run_dir, "db_url": None})
    base_model_dir = str(resolve_model_dir(settings.model))  # fetch/convert once, up front
    admin_key = secrets.token_urlsafe(16)
    if turns_per_update is None:
        turns_per_update = settings.demo.turns_per_update
    env = _child_env(settings, admin_key, turns_per_update)
    env.update(extra_env)
    env["LIVELOOP_TRAINER__OBJECTIVE"] = objective
    supervisor = Supervisor(child, config_files=config_files, extra_env=env)
    defaults = model_defaults(settings.model)
    seconds = settings.demo.minutes * 60
    supervisor.start()
    try:
        wait_ready(supervisor.base_url, supervisor)
        started, started_at = time.monotonic(), time.time()
        run = UserRun(
            base_url=supervisor.base_url,
            model=settings.model,
            max_tokens=defaults.reply_tokens,
            retries=settings.demo.retries_after_complaint,
            sample_seed=settings.demo.live_sample_seed(),
        )
        people = make_population(
            settings.demo.users,
            settings.demo.seed,
            defaults.word_limits,
            strict=defaults.has_language,
            weather_share=settings.demo.weather_share,
        )
        title = f"LiveLoop demo ({objective})"
        with LiveView(supervisor, quiet=quiet, title=title) as view:
            (stats,) = drive(
                [(run, people)],
                seconds,
                settings.demo.seed,
                supervisor,
                view,
                max_judged_turns,
                turns_per_update,
            )
        log.info(
            "population done after %.0fs: %d answers", time.monotonic() - started, len(stats.turns)
        )
        time.sleep(3.0)  # let the judge score the last replies
        turns = read_judged(supervisor.redis_url)
        if max_judged_turns is not None:
            turns = turns[:max_judged_turns]
        summary = summarise(turns, settings.demo.window_turns, settings.demo.reward_threshold)
        summary.update(
            model=settings.model,
            objective=objective,
            minutes=settings.demo.minutes,
            turns_per_update=turns_per_update,
            user_errors=stats.errors,
            wall_seconds=time.time() - started_at,
            reactions=user_reactions(stats.turns, settings.demo.window_turns, stats.tool_asks),
        )
        _add_wall_clock(summary, turns, started_at)
        summary["eval"], summary["hint_examples"] = compare_versions(
            supervisor, admin_key, base_model_dir, settings, turns
        )
        summary["training"] = training_figures(read_update_metrics(supervisor.redis_url))
        add_registry_quality(summary, child.effective_db_url)
    finally:
        supervisor.stop()
    return ObjectiveRun(objective, summary, turns, started_at)


def _add_wall_clock(summary: dict[str, Any], turns: list[JudgedTurn], started_at: float) -> None:
    """Minutes from the users' start until the turn that reached the threshold."""
    reached = summary.get("turns_to_threshold")
    summary["minutes_to_threshold"] = (
        (turns[reached - 1].judged_at - started_at) / 60 if reached else None
    )

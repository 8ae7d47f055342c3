"""The tenants demo's report: each tenant's gain in tenant scope against shared scope.

`report.json` holds every figure of every scope run; `report.md` leads with the matrix (one
row per tenant: judged reward first -> last window in each scope, the difference of the two
gains, whether its quality checks held), then held-out reward, the isolation checks read
back from the streams, and each tenant's replies to the same questions at the end.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from liveloop.config import LiveLoopSettings
from liveloop.demo.render import plus_minus
from liveloop.demo.styles import Tenant

TARGET_MARGIN = 0.2  # a conflicting tenant's gain in tenant scope beats shared scope by this
CONFLICTING = ("brief", "explained")  # the styles that pull one shared policy apart


@dataclass
class ScopeRun:
    """One run of the loops in one trainer scope: per-tenant figures and the isolation checks."""

    scope: str
    tenants: dict[str, dict[str, Any]] = field(default_factory=dict)  # by tenant label
    isolation: dict[str, Any] = field(default_factory=dict)
    judged_turns: int = 0
    served_versions: int = 0  # distinct (adapter, version) pairs that served judged turns


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f}"


def matrix(tenants: list[Tenant], runs: list[ScopeRun]) -> list[dict[str, Any]]:
    """One row per tenant: its figures in each scope and, with both, the gains' difference."""
    rows = []
    for tenant in tenants:
        row: dict[str, Any] = {"label": tenant.label, "style": tenant.style}
        for run in runs:
            row[run.scope] = run.tenants[tenant.label]
        gains = [row.get(s, {}).get("gain") for s in ("tenant", "shared")]
        row["gain_difference"] = _difference(gains[0], gains[1])
        row["gain_difference_se"] = _combined_error(
            [row.get(s, {}).get("gain_se") for s in ("tenant", "shared")]
        )
        held = [_held_out_gain(row.get(s)) for s in ("tenant", "shared")]
        row["held_out_gain_difference"] = _difference(held[0], held[1])
        rows.append(row)
    return rows


def _difference(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def _combined_error(errors: list[float | None]) -> float | None:
    """The standard error of a difference of independent estimates with these errors."""
    if not errors or any(e is None for e in errors):
        return None
    return math.sqrt(sum(e * e for e in errors if e is not None))


def _held_out_gain(figures: dict[str, Any] | None) -> float | None:
    """The tenant's held-out users' reward, what it is served at the end minus the base."""
    held = (figures or {}).get("held_out_reward") or {}
    return _difference(held.get("final"), held.get("base"))


def headline(rows: list[dict[str, Any]], runs: list[ScopeRun]) -> dict[str, Any]:
    """Whether personal adapters beat one shared policy for the conflicting tenants, with
    every quality check kept and no isolation check failed."""
    conflicting = [r for r in rows if r["style"] in CONFLICTING]
    differences = {r["label"]: r["gain_difference"] for r in conflicting}
    kept = all(
        all(r[s]["quality_kept"].values()) for r in conflicting for s in ("tenant", "shared")
        if s in r
    )  # fmt: skip
    isolated = all(run.isolation.get("passed") for run in runs)
    beats = bool(differences) and all(
        d is not None and d > TARGET_MARGIN for d in differences.values()
    )
    return {
        "gain_difference": differences,
        # One standard error of each difference: with a margin of the same size, a single
        # run's verdict can go either way on sampling alone.
        "gain_difference_se": {r["label"]: r.get("gain_difference_se") for r in conflicting},
        # The same held-out users and questions before and after, beside the live windows
        # (whose turns come from every version served in the run).
        "held_out_gain_difference": {
            r["label"]: r["held_out_gain_difference"] for r in conflicting
        },
        "quality_kept": kept,
        "isolation_passed": isolated,
        "tenant_scope_beats_shared": beats and kept and isolated,
        "margin": TARGET_MARGIN,
    }


def _users_per_tenant(tenants: list[dict[str, Any]]) -> str:
    return ", ".join(f"{t['users']} {t['style']}" for t in tenants)


def write_tenant_report(
    out_dir: Path, settings: LiveLoopSettings, tenants: list[Tenant], runs: list[ScopeRun]
) -> dict[str, Path]:
    """Write report.json and report.md; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = matrix(tenants, runs)
    report = {
        "model": settings.model,
        "minutes": settings.demo.minutes,
        "users": sum(len(t.people) for t in tenants),
        "tenants": [{"label": t.label, "style": t.style, "users": len(t.people)} for t in tenants],
        "scopes": {
            run.scope: {
                "judged_turns": run.judged_turns,
                "served_versions": run.served_versions,
                "isolation": run.isolation,
            }
            for run in runs
        },
        "matrix": rows,
        "headline": headline(rows, runs),
    }
    paths = {"json": out_dir / "report.json", "md": out_dir / "report.md"}
    paths["json"].write_text(json.dumps(report, indent=2))
    paths["md"].write_text(render(report))
    return paths


def render(report: dict[str, Any]) -> str:
    """The markdown report."""
    scopes = list(report["scopes"])
    top = report["headline"]
    lines = [
        "# LiveLoop tenants demo report",
        "",
        f"{report['model']}, {len(report['tenants'])} tenants, {report['users']} users "
        f"({_users_per_tenant(report['tenants'])}), {report['minutes']:g} minutes in each "
        f"scope ({', '.join(scopes)}).",
        "",
        "## Judged reward per tenant, first -> last window",
        "",
        *_table(report["matrix"], scopes, _cell, "gain_difference"),
        "",
        f"Tenant scope beats shared scope by more than {top['margin']} for the conflicting "
        f"tenants, quality kept, isolation passed: **{top['tenant_scope_beats_shared']}** "
        f"(quality kept: {top['quality_kept']}; isolation passed: {top['isolation_passed']}). "
        "A difference is given with one standard error of its four windows' means: the "
        "margin is about that size, so one run's verdict can turn on sampling alone. "
        "Versions are the trained versions that served the tenant's judged turns: an adapter "
        "learns from its own tenant's turns alone and the shared policy from everyone's, so in "
        "the same minutes an adapter gets fewer, and fewer still on a slower machine "
        "(`--minutes` gives every scope more). "
        "Held-out users' gain differences, the same users and questions before and after: "
        + ", ".join(f"{k} {_fmt(v)}" for k, v in top["held_out_gain_difference"].items())
        + ".",
        "",
        "## Held-out users of each tenant: base -> what the tenant is served at the end",
        "",
        *_table(report["matrix"], scopes, _held_out, "held_out_gain_difference"),
    ]
    lines += ["", "## Why each tenant's users were (dis)pleased, first -> last window", ""]
    for row in report["matrix"]:
        for scope in scopes:
            lines.append(f"- {row['label']}, {scope} scope: {_reasons(row[scope])}")
    lines += ["", "## Isolation, read back from the streams", ""]
    for scope, figures in report["scopes"].items():
        iso = figures["isolation"]
        lines.append(
            f"- {scope} scope: {iso['turns_checked']} judged turns, "
            f"{iso['served_by_another_tenants_adapter']} served by another tenant's adapter; "
            f"{iso['batches_checked']} batches, {iso['batches_mixing_tenants']} mixing tenants."
        )
    lines += ["", "## The same questions, asked of every tenant at the end (temperature 0)"]
    lines += _same_questions(report["matrix"], scopes)
    return "\n".join(lines) + "\n"


def _table(
    rows: list[dict[str, Any]],
    scopes: list[str],
    cell: Callable[[dict[str, Any]], str],
    difference: str,
) -> list[str]:
    """A markdown table: a row per tenant, a column per scope, and the gains' difference
    (`difference`: the row's key of it; with its standard error where the row has one)."""
    lines = [
        "| tenant | " + " | ".join(f"{s} scope" for s in scopes) + " | gain difference |",
        "|---" * (len(scopes) + 2) + "|",
    ]
    for row in rows:
        spread = plus_minus(row.get(f"{difference}_se"))
        last = f" {_fmt(row.get(difference))}{spread} |"
        lines.append(
            f"| {row['label']} | " + " | ".join(cell(row[s]) for s in scopes) + " |" + last
        )
    return lines


def _same_questions(rows: list[dict[str, Any]], scopes: list[str]) -> list[str]:
    """Per question, each tenant's reply in each scope (with the version that gave it)."""
    lines: list[str] = []
    questions = [ask["question"] for ask in rows[0][scopes[0]]["same_questions"]] if rows else []
    for i, question in enumerate(questions):
        lines += ["", f"*{question}*", ""]
        for row in rows:
            for scope in scopes:
                ask = row[scope]["same_questions"][i]
                reply = " ".join(str(ask["reply"]).split()) or "(empty)"
                lines.append(f"- {row['label']}, {scope} scope (v{ask['version']}): {reply}")
    return lines


def _cell(figures: dict[str, Any]) -> str:
    kept = figures["quality_kept"]
    lost = [k for k, v in kept.items() if not v]
    quality = "quality kept" if not lost else "lost: " + ", ".join(lost)
    return (
        f"{_fmt(figures['reward_first_window'])} -> {_fmt(figures['reward_last_window'])} "
        f"(gain {_fmt(figures['gain'])}, {figures['turns']} turns, "
        f"{_plural(_trained_versions(figures), 'version')}; {quality})"
    )


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _trained_versions(figures: dict[str, Any]) -> int:
    """Trained versions (not the base) that served the tenant's judged turns."""
    return sum(1 for version in figures.get("versions") or [] if version > 0)


def _held_out(figures: dict[str, Any]) -> str:
    held = figures["held_out_reward"]
    return f"{_fmt(held['base'])} -> {_fmt(held['final'])} (gain {_fmt(_held_out_gain(figures))})"


def _reasons(figures: dict[str, Any]) -> str:
    """The users' reasons in the first and the last window, with the weather tool's use."""
    said = figures.get("reactions") or {}

    def shares(window: dict[str, float]) -> str:
        return ", ".join(f"{reason} {share:.0%}" for reason, share in window.items()) or "none"

    text = f"{shares(said.get('first') or {})} -> {shares(said.get('last') or {})}"
    if said.get("weather_questions"):
        text += f"; {said['questions_called']} of {said['weather_questions']} weather questions "
        text += "got a tool call first"
    if said.get("weather_answers"):
        text += f"; {said['answers_after_tool']} of {said['weather_answers']} weather answers "
        text += "came after a tool call"
    return text

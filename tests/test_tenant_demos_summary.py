"""`bench/tenant_demos.py`: kept tenants-demo runs are wrapped with their provenance and
summed up over runs, telling a run ahead by the margin from one that met the target."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from bench.tenant_demos import main, reaction_shifts, summary, wrap


def _scope(gain: float, kept: bool) -> dict[str, Any]:
    return {"gain": gain, "quality_kept": {"topic_rate": True, "non_answers": kept}}


def _report(brief: tuple[float, float], explained: tuple[float, float], shared_kept: bool,
            tenant_turns: int = 400) -> dict[str, Any]:  # fmt: skip
    """A demo report of the shape `liveloop demo --tenants 3` writes (the fields read)."""
    rows = []
    for style, (tenant, shared) in (("brief", brief), ("explained", explained)):
        rows.append(
            {
                "style": style,
                "label": style,
                "tenant": _scope(tenant, True),
                "shared": _scope(shared, shared_kept),
                "gain_difference": tenant - shared,
            }
        )
    rows.append(
        {
            "style": "weather_tool",
            "tenant": _scope(0.0, False),
            "shared": _scope(0.0, False),
            "gain_difference": 0.0,
        }
    )
    ahead = all(r["gain_difference"] > 0.2 for r in rows[:2])
    return {
        "minutes": 20.0,
        "scopes": {"tenant": {"judged_turns": tenant_turns}, "shared": {"judged_turns": 350}},
        "matrix": rows,
        "headline": {
            "margin": 0.2,
            "quality_kept": shared_kept,
            "isolation_passed": True,
            "tenant_scope_beats_shared": ahead and shared_kept,
        },
    }


def _one_scope(report: dict[str, Any]) -> dict[str, Any]:
    """The report of a run with `demo.scopes = ["tenant"]`: no shared-scope cells."""
    for row in report["matrix"]:
        del row["shared"]
    return report


def test_summary_counts_runs_ahead_and_runs_that_met_the_target() -> None:
    results = {
        "met.json": {
            "command": "LIVELOOP_DEMO__SEED=4 liveloop demo --tenants 3",
            "report": _report((0.5, 0.1), (0.6, 0.2), shared_kept=True),
        },
        "ahead.json": {"report": _report((0.4, 0.0), (0.5, 0.1), shared_kept=False)},
        "behind.json": {"report": _report((0.3, 0.2), (0.5, 0.1), shared_kept=True)},
        "tenant-only.json": {"report": _one_scope(_report((0.9, 0.0), (0.9, 0.0), True))},
    }
    out = summary(results)
    assert out["one_scope_runs"] == ["tenant-only.json"]
    rows = {r["file"]: r for r in out["runs"]}
    assert (out["met"], out["ahead"], out["of"]) == (1, 2, 3)
    assert rows["met.json"]["seed"] == 4 and rows["ahead.json"]["seed"] is None
    assert rows["ahead.json"]["ahead"] and not rows["ahead.json"]["met"]
    assert rows["ahead.json"]["quality_kept_by_scope"] == {"tenant": True, "shared": False}
    brief = out["over_runs"]["brief"]["gain_difference"]
    assert brief["n"] == 3 and brief["mean"] == pytest.approx((0.4 + 0.4 + 0.1) / 3)
    assert brief["mean_se"] == pytest.approx(statistics.stdev([0.4, 0.4, 0.1]) / math.sqrt(3))
    assert brief["min"] == pytest.approx(0.1)


def _with_reactions(report: dict[str, Any], scope: str, first: dict[str, float],
                    last: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    """`report` with the explained tenant's users' reactions by window in `scope`."""
    row = next(r for r in report["matrix"] if r["style"] == "explained")
    row[scope]["reactions"] = {"window": 64, "first": first, "last": last}
    return report


def test_reaction_shifts_say_which_complaints_each_scope_cured() -> None:
    one = _with_reactions(
        _report((0.5, 0.1), (0.6, 0.2), True),
        "shared",
        {"off_topic": 0.5, "pleased": 0.5},
        {"off_topic": 0.1, "pleased": 0.9},
    )
    two = _with_reactions(
        _report((0.5, 0.1), (0.6, 0.2), True),
        "shared",
        {"off_topic": 0.3, "opening": 0.2, "pleased": 0.5},
        {"pleased": 1.0},
    )
    two = _with_reactions(two, "tenant", {"opening": 0.5, "pleased": 0.5}, {"pleased": 1.0})
    shared = reaction_shifts([one, two], "explained", "shared")
    assert set(shared) == {"off_topic", "opening", "pleased"}
    assert shared["off_topic"]["mean"] == pytest.approx((-0.4 - 0.3) / 2)
    assert shared["opening"]["mean"] == pytest.approx(-0.1)  # absent from run one: no shift
    assert shared["pleased"]["n"] == 2 and shared["pleased"]["mean"] == pytest.approx(0.45)
    tenant = reaction_shifts([one, two], "explained", "tenant")  # run one has none there
    assert tenant["opening"]["n"] == 1 and tenant["opening"]["mean"] == pytest.approx(-0.5)
    assert reaction_shifts([one], "brief", "shared") == {}
    out = summary({"one.json": {"report": one}, "two.json": {"report": two}})
    assert out["over_runs"]["explained"]["reaction_shifts"]["shared"] == shared


def test_wrap_keeps_the_report_and_summary_reads_it_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / "report.json").write_text(json.dumps(_report((0.5, 0.1), (0.6, 0.2), True)))
    wrapped = wrap(demo, "LIVELOOP_DEMO__SEED=7 liveloop demo --tenants 3", "a note", 47.5)
    assert wrapped["note"] == "a note" and wrapped["wall_minutes"] == 47.5
    assert wrapped["report"]["headline"]["tenant_scope_beats_shared"] is True
    assert {"date", "commit", "machine"} <= wrapped.keys()
    assert wrap(demo, "liveloop demo", "", None, commit="abc1234")["commit"] == "abc1234"
    kept = tmp_path / "demo-2026-11-28-tenants-x.json"
    assert main(["wrap", str(demo), "--command", wrapped["command"], "--out", str(kept)]) == 0
    assert main(["summary", str(kept)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["met"], printed["of"]) == (1, 1) and printed["runs"][0]["seed"] == 7
    assert main(["summary", str(kept), "--minutes", "30"]) == 0  # a 30-minute run: none
    assert json.loads(capsys.readouterr().out)["of"] == 0


def test_summary_reads_the_runs_by_pace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--min-tenant-turns` keeps the runs whose tenant scope judged that many turns: a slow
    machine's run (fewer turns, fewer versions) is left out, and each run says its turns."""
    for name, turns, brief in (("fast", 560, (0.6, 0.1)), ("slow", 220, (0.1, 0.0))):
        report = _report(brief, (0.5, 0.1), True, tenant_turns=turns)
        (tmp_path / f"demo-x-tenants-{name}.json").write_text(json.dumps({"report": report}))
    files = sorted(str(p) for p in tmp_path.iterdir())
    assert main(["summary", *files]) == 0
    every = json.loads(capsys.readouterr().out)
    assert (every["met"], every["of"]) == (1, 2)
    turns = {r["file"]: r["judged_turns"] for r in every["runs"]}
    assert turns["demo-x-tenants-slow.json"] == {"tenant": 220, "shared": 350}
    assert main(["summary", *files, "--min-tenant-turns", "500"]) == 0
    fast = json.loads(capsys.readouterr().out)
    assert (fast["met"], fast["of"]) == (1, 1)
    assert [r["file"] for r in fast["runs"]] == ["demo-x-tenants-fast.json"]
    assert fast["over_runs"]["brief"]["gain_difference"]["mean"] == pytest.approx(0.5)

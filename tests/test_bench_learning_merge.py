"""bench/learning.py's `--merge` (in bench/learning_summary.py): seeds run in separate
sittings make one comparison (a wrong merge would count a seed twice or mix two budgets into
one verdict)."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ARGS = {"turns": "96", "window": "24", "threshold": "None", "users": "8", "pace": "12"}


@pytest.fixture(scope="module")
def learning() -> Iterator[ModuleType]:
    path = Path(__file__).resolve().parent.parent / "bench" / "learning_summary.py"
    spec = importlib.util.spec_from_file_location("bench_learning_summary", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _run(arm: str, seed: int, turns: int | None) -> dict[str, Any]:
    return {
        "arm": arm,
        "objective": "rl" if arm == "rl" else "combine",
        "opd": {},
        "seed": seed,
        "turns_to_threshold": turns,
        "improvement": 0.5,
        "reward_last_window": 0.3,
        "held_out_reward": 0.1,
        "hint_share": 0.0,
        "rejected_versions": [],
        "training": {"seconds": 40.0},
        "held_out_quality": {"topic_rate": 0.9},
    }


def _write(path: Path, runs: list[dict[str, Any]], **args: str) -> Path:
    data: dict[str, Any] = {"date": "d", "commit": "c", "command": "python bench/learning.py"}
    data |= {"args": {**ARGS, "compare": "big,rl", **args}, "models": {"m": {"runs": runs}}}
    path.write_text(json.dumps(data))
    return path


def test_seeds_from_two_files_make_one_verdict(learning: ModuleType, tmp_path: Path) -> None:
    one = _write(tmp_path / "a.json", [_run("rl", 0, 50), _run("big", 0, 30)])
    two = _write(tmp_path / "b.json", [_run("rl", 1, 70), _run("big", 1, None)])
    merged = learning.merge_results([one, two], None)
    model = merged["models"]["m"]
    assert [(r["arm"], r["seed"]) for r in model["runs"]] == [
        ("rl", 0),
        ("big", 0),
        ("rl", 1),
        ("big", 1),
    ]
    assert model["per_arm"]["rl"]["turns_to_threshold_capped"]["mean"] == 60.0
    # the unreached threshold counts as the 96-turn budget: big (30 + 96) / 2 = 63 > rl's 60
    assert model["per_arm"]["big"]["turns_to_threshold_capped"]["mean"] == 63.0
    assert model["big_vs_rl"]["big_fewer_turns_than_rl"] == -3.0
    assert model["big_vs_rl"]["verdict"] == "not met"
    assert [m["file"] for m in merged["merged_from"]] == ["a.json", "b.json"]


def test_a_seed_twice_another_budget_or_another_arm_is_refused(
    learning: ModuleType, tmp_path: Path
) -> None:
    one = _write(tmp_path / "a.json", [_run("rl", 0, 50)])
    again = _write(tmp_path / "b.json", [_run("rl", 0, 40)])
    with pytest.raises(SystemExit, match="arm rl seed 0 twice"):
        learning.merge_results([one, again], None)
    longer = _write(tmp_path / "c.json", [_run("rl", 1, 40)], turns="200")
    with pytest.raises(SystemExit, match=r"c.json: not the same comparison .*turns"):
        learning.merge_results([one, longer], None)
    other_teacher = _write(tmp_path / "d.json", [{**_run("rl", 1, 40), "objective": "combine"}])
    with pytest.raises(SystemExit, match="arm rl is not the same arm in each"):
        learning.merge_results([one, other_teacher], None)

"""`liveloop up` (four supervised loops) and `liveloop demo` (a learning curve), end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
import pytest

from liveloop.valkey import free_port_block

CLI = [sys.executable, "-m", "liveloop.cli"]


def _loop_children(parent: psutil.Process) -> dict[str, psutil.Process]:
    loops = {}
    for child in parent.children():
        try:
            cmd = child.cmdline()
        except psutil.Error:  # a killed loop stays a zombie until the supervisor reaps it
            continue
        if "liveloop.cli" in cmd:
            loops[cmd[cmd.index("liveloop.cli") + 1]] = child
    return loops


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "liveloop up exited early"
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("server never became ready")


@pytest.mark.slow
def test_up_runs_restarts_and_stops_everything(tmp_path: Path) -> None:
    port = free_port_block()
    cmd = [
        *CLI,
        "up",
        "--model",
        "tiny-random",
        "--port",
        str(port),
        "--data-dir",
        str(tmp_path),
        "--quiet",
    ]
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    parent = psutil.Process(proc.pid)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", proc)
        loops = _loop_children(parent)
        assert set(loops) == {"serve", "judge", "collect", "train"}
        # loops sharing the cores: their OpenMP workers sleep when idle instead of spinning
        assert all(p.environ().get("OMP_WAIT_POLICY") == "PASSIVE" for p in loops.values())
        everything = parent.children(recursive=True)
        assert any("valkey-server" in " ".join(p.cmdline()) for p in everything)

        loops["judge"].kill()  # a crashed loop is restarted, the others keep running
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            judge = _loop_children(parent).get("judge")
            if judge is not None and judge.pid != loops["judge"].pid:
                break
            time.sleep(0.3)
        else:
            raise AssertionError("the killed judge loop was not restarted")
        assert loops["serve"].is_running()

        everything = parent.children(recursive=True)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert time.monotonic() - started < 10
        time.sleep(0.5)
        alive = [p for p in everything if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert alive == [], [p.cmdline() for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
@pytest.mark.solo
def test_demo_on_tiny_random_learns_within_four_minutes(tmp_path: Path) -> None:
    port = free_port_block()
    cmd = [*CLI, "demo", "--model", "tiny-random", "--minutes", "4", "--port", str(port)]
    cmd += ["--data-dir", str(tmp_path), "--quiet"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "demo"
    assert str(out / "report.md") in done.stdout
    report = json.loads((out / "report.json").read_text())
    assert (out / "reward.png").stat().st_size > 10_000
    assert "# LiveLoop demo report" in (out / "report.md").read_text()
    assert report["judged_turns"] >= 2 * report["window_turns"]
    assert report["policy_versions"] > 1
    # A session's last reply has no next turn: the user's thumbs and comment judge it.
    assert report["judged_on"].get("feedback", 0) > 0, report["judged_on"]
    statuses = Counter(str(e.get("status")) for e in report["platform"].values())
    learned = report["reward_last_window"] - report["reward_first_window"]
    assert learned >= 0.3, (
        learned,
        report["policy_versions"],
        statuses,
        report["reward_per_window"],
    )
    held_out = report["eval"]
    assert "version 0" in held_out and any("final" in k for k in held_out)
    assert "never retrieved" not in done.stderr  # e.g. a client closed after its loop
    # Quality beside the reward: the platform's per-version measures, the gate's probes,
    # the held-out replies of both versions, and a headline that states both.
    platform = report["platform"]
    assert platform["0"]["probe"]["ref_nll"] > 0 and platform["0"]["status"] == "base"
    served = [e["served"] for e in platform.values() if e.get("served")]
    assert any(s["ref_nll"] is not None and s["judged"] > 0 for s in served)
    assert any(e.get("status") == "accepted" and e.get("probe") for e in platform.values())
    headline = report["headline"]
    assert headline["reward_gain"] == report["improvement"]
    assert set(headline["quality_kept"]) == {"topic_rate", "ref_nll", "symbols", "non_answers"}
    assert all(len(row["replies"]) == 24 for row in held_out.values())
    markdown = (out / "report.md").read_text()
    assert "Judged reward gain" in markdown and "The same held-out questions" in markdown
    probes = headline["tool_call_rate"]  # the same weather questions asked of both versions
    assert probes["version 0"]["questions"] == probes["final"]["questions"] == 32
    assert 0 <= probes["final"]["called"] <= 32
    assert "first reply called the weather tool: version 0 " in markdown
    said = report["reactions"]  # every recorded answer has its user's reason
    assert sum(said["first"].values()) == pytest.approx(1.0)
    assert "## What the users said" in markdown
    eval_cmd = [*CLI, "eval", "--data-dir", str(out / "run")]
    table = subprocess.run(eval_cmd, capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr[-2000:]
    header, first = table.stdout.splitlines()[:2]
    assert "probe-reward" in header and first.split()[:2] == ["0", "base"]


@pytest.mark.slow
def test_eval_runs_held_out_users_against_one_version(tmp_path: Path) -> None:
    base = [*CLI, "eval", "--model", "tiny-random", "--data-dir", str(tmp_path)]
    missing = subprocess.run([*base, "--version", "7"], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "policy version 7 is not in the registry" in missing.stderr
    done = subprocess.run([*base, "--version", "0"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout[done.stdout.index("{") :])
    assert result["version"] == 0
    assert result["turns"] == 24  # 6 held-out users x 4 answers each
    assert -1.0 <= result["mean_reward"] <= 1.0


@pytest.mark.slow
@pytest.mark.solo
def test_demo_with_opd_on_tiny_random_distils_from_its_hints(tmp_path: Path) -> None:
    """`--objective opd` end to end: the rules judge turns the users' corrections into
    directive hints, the trainer trains on the hinted turns with a teacher told the hint
    (another model loaded frozen in the trainer: smollm2-135m, which shares tiny-random's
    tokenizer), and each update moves the student's log-probs of the taught tokens towards
    the teacher's. (The policy as its own teacher is the tiny-random preset's `combine`
    demo, above, and `test_opd.py`'s updates.) That is what tiny-random can learn from a hint: it has no
    language, so its reward is not expected to rise (bench/learning.py asks that of a real
    model).

    The learning rate is the trainer's default order (1e-5): Adam steps at the demo's
    tiny-random rate (2e-2) are far larger than this teacher's distance from its student.
    """
    port = free_port_block()
    cmd = [*CLI, "demo", "--model", "tiny-random", "--minutes", "1", "--objective", "opd"]
    cmd += ["--port", str(port), "--data-dir", str(tmp_path), "--quiet"]
    env = {**os.environ, "LIVELOOP_TRAINER__LR": "1e-5",
           "LIVELOOP_TRAINER__OPD__TEACHER": "model",
           "LIVELOOP_TRAINER__OPD__TEACHER_MODEL": "smollm2-135m"}  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert report["objective"] == "opd" and list(report["objectives"]) == ["opd"]
    assert report["hint_share"] > 0.2
    training = report["training"]
    assert training["updates_with_opd"] >= 3 and training["opd_skipped"] == {}
    assert training["opd_gap_after"] < training["opd_gap_before"], training
    examples = report["hint_examples"]
    assert examples and all(e["hint"] and e["before"] and e["after"] for e in examples)
    markdown = (tmp_path / "demo" / "report.md").read_text()
    assert "## Directive hints" in markdown and "updates distilled from a teacher" in markdown

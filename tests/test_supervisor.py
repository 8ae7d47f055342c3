"""The supervisor restarts a crashed loop and says why it crashed (its log's last line)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from liveloop.config import load_settings
from liveloop.supervisor import LoopProcess, Supervisor, exit_reason, last_log_line

CRASH = "import sys; print('loading...'); sys.exit('RuntimeError: tensors on cuda:0 and cpu')"


def test_a_crashed_loop_is_restarted_and_its_error_named(tmp_path: Path) -> None:
    settings = load_settings([], model="tiny-random", data_dir=tmp_path)
    supervisor = Supervisor(settings, loops=())
    loop = LoopProcess(
        "train", [sys.executable, "-c", CRASH], {"PYTHONUNBUFFERED": "1"}, tmp_path / "train.log"
    )
    supervisor.loops.append(loop)
    loop.start()
    assert loop.process is not None
    loop.process.wait(30)
    (event,) = supervisor.check()
    assert event == (
        "train exited with 1 (RuntimeError: tensors on cuda:0 and cpu); restarting in 1s"
    )
    time.sleep(1.1)
    assert supervisor.check() == ["train restarted"]
    loop.process.wait(30)
    assert "restarting in 2s" in supervisor.check()[0]  # backoff doubles


def test_last_log_line_reads_the_tail_only(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    assert last_log_line(log) == ""  # no log yet
    log.write_bytes(b"early line\n" + b"x" * 20_000 + b"\nValueError: bad \xff input\n\n")
    assert last_log_line(log) == "ValueError: bad \ufffd input"
    log.write_text("y" * 500 + "\n")
    assert last_log_line(log, width=20) == "y" * 17 + "..."


def test_a_killed_loop_is_named_by_its_signal_not_its_log(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_text("INFO v8 accepted: 13 samples\n")
    assert exit_reason(-9, log) == "killed by SIGKILL"
    assert exit_reason(1, log) == "INFO v8 accepted: 13 samples"
    assert exit_reason(0, log) == ""

"""The `liveloop` command: one-line errors with non-zero exits, and `liveloop redis`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis

from liveloop.valkey import EmbeddedValkey, free_port

CLI = [sys.executable, "-m", "liveloop.cli"]


def run_cli(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], needle: str) -> None:
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert lines, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert needle in lines[-1], proc.stderr


def test_unknown_config_key(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[trainer]\nlearning_rate = 0.1\n")
    assert_one_line_error(
        run_cli("train", "--config", str(cfg)), "trainer.learning_rate: unknown setting"
    )


def test_bad_flag_value_names_the_key(tmp_path: Path) -> None:
    env = dict(os.environ, LIVELOOP_SERVER__MAX_BATCH_SIZE="zero")
    assert_one_line_error(run_cli("serve", env=env), "server.max_batch_size")


def test_liveloop_redis_runs_in_foreground_and_stops(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*CLI, "redis", "--data-dir", str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "embedded Valkey at redis://" in line
        url = line.split(" at ")[1].split()[0]
        client = redis.Redis.from_url(url)
        assert client.ping()
        client.close()
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        for child in children:
            assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("command", ["judge", "collect", "train"])
def test_unreachable_redis_is_one_line(command: str, tmp_path: Path) -> None:
    proc = run_cli(
        command,
        "--redis-url",
        "redis://127.0.0.1:1/0",
        "--data-dir",
        str(tmp_path),
        "--model",
        "tiny-random",
    )
    assert_one_line_error(proc, "cannot reach Redis")


def _wait_for_line(log_file: Path, needle: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if needle in log_file.read_text(errors="replace"):
            return
        assert proc.poll() is None, log_file.read_text(errors="replace")
        time.sleep(0.2)
    raise AssertionError(f"no {needle!r} in the log: {log_file.read_text(errors='replace')}")


def test_train_stops_on_sigterm_while_redis_is_down(tmp_path: Path) -> None:
    valkey = EmbeddedValkey(tmp_path).start()
    env = dict(os.environ, LIVELOOP_TRAINER__GATE__ENABLED="false")
    args = ["--model", "tiny-random", "--data-dir", str(tmp_path), "--redis-url", valkey.url]
    log_file = tmp_path / "train.log"
    with log_file.open("wb") as out:
        proc = subprocess.Popen([*CLI, "train", *args], stdout=out, stderr=out, env=env)
    try:
        _wait_for_line(log_file, "training tiny-random from v0", proc)
        valkey.stop()
        _wait_for_line(log_file, "Redis unavailable", proc)
        proc.send_signal(signal.SIGTERM)  # e.g. from its supervisor, gone with Redis
        assert proc.wait(20) == 0
    finally:
        valkey.stop()
        if proc.poll() is None:
            proc.kill()


def test_sglang_engine_without_servers_is_refused(redis_url: str, tmp_path: Path) -> None:
    env = dict(os.environ, LIVELOOP_SERVER__ENGINE="sglang")
    proc = run_cli("serve", "--redis-url", redis_url, "--data-dir", str(tmp_path), env=env)
    assert_one_line_error(proc, "server.engine 'sglang' needs SGLang servers")


def test_unreachable_sglang_servers_are_one_line(redis_url: str, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    args = ("--redis-url", redis_url, "--data-dir", str(tmp_path), "--model", "tiny-random")
    proc = run_cli("serve", "--engine", "sglang", "--sglang-url", url, "--port", "0", *args)
    assert_one_line_error(proc, f"no SGLang server answered at {url}")


def test_third_party_info_is_quiet_unless_debug(tmp_path: Path) -> None:
    # `liveloop eval` opens the registry: alembic runs its migrations, which log at INFO.
    quiet = run_cli("eval", "--data-dir", str(tmp_path / "a"))
    assert quiet.returncode == 0, quiet.stderr
    assert "alembic" not in quiet.stderr and "INFO" not in quiet.stderr
    env = dict(os.environ, LIVELOOP_LOG_LEVEL="debug")
    verbose = run_cli("eval", "--data-dir", str(tmp_path / "b"), env=env)
    assert verbose.returncode == 0 and "alembic" in verbose.stderr
    flag = run_cli("eval", "--data-dir", str(tmp_path / "c"), "--log-level", "DEBUG")
    assert flag.returncode == 0 and "alembic" in flag.stderr
    assert_one_line_error(
        run_cli("eval", "--data-dir", str(tmp_path / "d"), "--log-level", "loud"), "log level"
    )


def test_own_info_lines_stay_third_party_ones_go() -> None:
    import logging

    from liveloop.logs import setup_logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        setup_logging("INFO", "test")
        assert logging.getLogger("liveloop.collector.loop").isEnabledFor(logging.INFO)
        assert not logging.getLogger("alembic.runtime.plugins").isEnabledFor(logging.INFO)
        assert not logging.getLogger("uvicorn.error").isEnabledFor(logging.INFO)
        setup_logging("warning", "test")
        assert not logging.getLogger("liveloop.collector.loop").isEnabledFor(logging.INFO)
    finally:
        logging.getLogger("liveloop").setLevel(logging.NOTSET)
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)

"""The embedded Valkey: starts on a free port, persists with AOF, dies with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import redis

from liveloop.valkey import EmbeddedValkey


def test_start_persist_restart(tmp_path: Path) -> None:
    with EmbeddedValkey(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        client.xadd("liveloop:turns", {"data": "{}"})
        client.close()
    assert (tmp_path / "valkey").is_dir()
    with EmbeddedValkey(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        assert client.xlen("liveloop:turns") == 1
        client.close()


def test_no_orphan_when_parent_is_killed(tmp_path: Path) -> None:
    code = (
        "import sys, time\n"
        "from liveloop.valkey import EmbeddedValkey\n"
        f"s = EmbeddedValkey({str(tmp_path)!r}).start()\n"
        "print(s.process.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    assert psutil.pid_exists(child_pid)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not psutil.pid_exists(child_pid) or psutil.Process(child_pid).status() == "zombie":
            break
        time.sleep(0.1)
    else:
        raise AssertionError("embedded Valkey outlived its killed parent")

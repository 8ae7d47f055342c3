"""`liveloop serve --engine sglang --launch 1 --device cpu`: the gateway runs its own SGLang.

It starts the server, serves through it, restarts it after a SIGKILL (sessions resume
once it is back and healthy), and stops it on exit. Runs apart from the other SGLang
tests (`make test-sglang`'s first run) so that no more than two servers exist at a time.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import psutil
import pytest
import redis

from tests.server_proc import API_KEYS, ServerProcess, db_url
from tests.support.sglang import CPU_ARGS, MODEL, SHIM_DIR, sglang_python

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_launch]

LAUNCH_DB = 14


@pytest.fixture(scope="module")
def gateway(
    valkey_server: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    url = db_url(valkey_server.url, LAUNCH_DB)
    redis.Redis.from_url(url).flushdb()
    env = {
        "LIVELOOP_API_KEYS": API_KEYS[0],
        "LIVELOOP_SERVER__SGLANG__PYTHON": str(sglang_python()),
        "LIVELOOP_SERVER__SGLANG__LAUNCH_ENV": json.dumps({"PYTHONPATH": str(SHIM_DIR)}),
        "LIVELOOP_SERVER__SGLANG__LAUNCH_ARGS": json.dumps(CPU_ARGS),
        "LIVELOOP_SERVER__SGLANG__HEALTH_INTERVAL_S": "0.5",
    }
    args = ["--engine", "sglang", "--launch", "1", "--device", "cpu"]
    server = ServerProcess(
        url, tmp_path_factory.mktemp("launch"), env=env, model=MODEL, extra_args=args
    )
    server.start(timeout_s=900)
    yield server
    server.stop(timeout_s=60)


def sglang_processes(gateway: ServerProcess) -> list[psutil.Process]:
    assert gateway.process is not None
    found = []
    for child in psutil.Process(gateway.process.pid).children(recursive=True):
        try:
            if "sglang.launch_server" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def chat(gateway: ServerProcess, session: str) -> Any:
    with openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=API_KEYS[0], max_retries=0) as c:
        return c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=3,
            extra_headers={"X-Session-Id": session},
        )


def ready(gateway: ServerProcess) -> bool:
    try:
        return httpx.get(gateway.base_url + "/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_launched_server_serves_is_restarted_and_stopped(gateway: ServerProcess) -> None:
    assert chat(gateway, "launch-1").choices[0].finish_reason in ("stop", "length")
    [first] = sglang_processes(gateway)
    os.killpg(first.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while ready(gateway) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ready(gateway), "/readyz must turn false while the only replica is down"
    deadline = time.monotonic() + 900
    while not ready(gateway):
        assert time.monotonic() < deadline, "the launched server was not restarted"
        time.sleep(1.0)
    [second] = sglang_processes(gateway)
    assert second.pid != first.pid
    assert chat(gateway, "launch-1").choices[0].finish_reason in ("stop", "length")
    group = [second, *second.children(recursive=True)]
    # SIGTERM: a graceful stop (uvicorn re-raises the signal once done: -15); not -9 (killed)
    assert gateway.stop(timeout_s=60) in (0, -signal.SIGTERM)
    _gone, alive = psutil.wait_procs(group, timeout=30)
    assert not alive, f"SGLang processes left behind: {[p.pid for p in alive]}"

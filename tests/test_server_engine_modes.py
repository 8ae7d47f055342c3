"""Where the engine runs: its worker process (default; if it dies, requests get 503 until a
new one is up, never a hang) or a thread of the server process (`engine_process = false`)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from liveloop.valkey import EmbeddedValkey
from tests.server_proc import ServerProcess, db_url

MESSAGES = [{"role": "user", "content": "Say something."}]


def children(pid: int) -> list[int]:
    """Pids of the live direct child processes of `pid`."""
    return [p.pid for p in psutil.Process(pid).children() if p.status() != psutil.STATUS_ZOMBIE]


def test_engine_in_a_thread_of_the_server(valkey_server: EmbeddedValkey, tmp_path: Path) -> None:
    env = {"LIVELOOP_SERVER__ENGINE_PROCESS": "false"}
    server = ServerProcess(db_url(valkey_server.url, 11), tmp_path, env=env).start()
    try:
        assert server.process is not None and children(server.process.pid) == []
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        stream = client.chat.completions.create(
            model="tiny-random",
            messages=MESSAGES,
            max_tokens=6,
            stream=True,
            seed=1,  # type: ignore[arg-type]
        )
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert "worker process" not in server.log()
    finally:
        server.stop()


def test_a_dead_engine_worker_means_503_then_a_new_worker(
    valkey_server: EmbeddedValkey, tmp_path: Path
) -> None:
    server = ServerProcess(db_url(valkey_server.url, 12), tmp_path).start()
    try:
        assert server.process is not None
        (worker,) = children(server.process.pid)
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=3)  # type: ignore[arg-type]
        assert reply.choices[0].message is not None
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(server.base_url + "/readyz").status_code == 200:
            assert time.monotonic() < deadline, "readiness never turned false"
            time.sleep(0.05)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=3)  # type: ignore[arg-type]
        assert caught.value.status_code == 503
        assert httpx.get(server.base_url + "/healthz").status_code == 200
        deadline = time.monotonic() + 60
        while httpx.get(server.base_url + "/readyz").status_code != 200:
            assert time.monotonic() < deadline, "no new engine worker"
            time.sleep(0.1)
        (new_worker,) = children(server.process.pid)
        assert new_worker != worker
        reply = client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=3)  # type: ignore[arg-type]
        assert reply.choices[0].message is not None
    finally:
        assert server.stop() is not None

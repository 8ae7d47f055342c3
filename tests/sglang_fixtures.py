"""Pytest plugin of the SGLang tests: two real SGLang servers on CPU for the whole session.

Loaded with `pytest_plugins = ["tests.sglang_fixtures"]`; its fixtures are only set up by
tests marked `sglang`, which `make test-sglang` runs (see tests/support/sglang.py).
`sglang_lora_servers` is a second pair, with SGLang's multi-LoRA enabled, for one module
at a time (tests that use it are also marked `sglang_launch`, which `make test-sglang`
runs apart from the session pair, so that at most two servers exist at a time).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from liveloop.config import SGLangConfig
from liveloop.server.engine.sglang.launcher import launch_command, server_env
from tests.support.sglang import SHIM_DIR, START_TIMEOUT_S, SGLangServers, cpu_config

LORA_CPU_DIR = Path(__file__).resolve().parent / "support" / "sglang_lora_cpu"
# `--max-lora-rank` of the LoRA servers: the first one takes only rank <= 8, so a rank-16
# adapter loads on the second server and fails on the first.
LORA_SERVER_RANKS = (8, 16)
LORA_MAX_RANK = 16
# A smaller KV cache than the session pair's (CPU_ARGS): ~1 GB less per server.
LORA_CPU_ARGS = ["--max-total-tokens", "8192", "--max-running-requests", "16"]


def lora_config(**overrides: object) -> SGLangConfig:
    """SGLang settings with multi-LoRA on this machine's CPU (launched servers)."""
    path = os.pathsep.join(str(p) for p in (SHIM_DIR, LORA_CPU_DIR))
    values: dict[str, object] = {
        "enable_lora": True,
        "max_lora_rank": LORA_MAX_RANK,
        "max_loras_per_batch": 4,
        "launch_env": {"PYTHONPATH": path},
    }
    values.update(overrides)
    return cpu_config(**values)


@pytest.fixture(scope="session")
def sglang_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServers]:
    """Two SGLang servers on smollm2-135m (at most two run at a time on this machine)."""
    servers = SGLangServers(2, tmp_path_factory.mktemp("sglang-logs"))
    if servers.external:  # already running (developing): neither started nor stopped here
        yield servers
        return
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()


@pytest.fixture
def sglang_urls(sglang_servers: SGLangServers) -> list[str]:
    """The servers' URLs, after restarting any that an earlier test killed."""
    sglang_servers.ensure_running()
    return sglang_servers.urls


def quiet_port() -> int:
    """A free port below Linux's ephemeral range (32768+), where the outgoing connections
    of other processes cannot take it during SGLang's two-minute start-up."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 32000")


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def spawn_lora_server(servers: SGLangServers, index: int) -> None:
    """Start one LoRA server on a fresh quiet port."""
    server = servers.servers[index]
    server.port = quiet_port()
    rank = LORA_SERVER_RANKS[index]
    cfg = lora_config(launch_args=[*LORA_CPU_ARGS, "--max-lora-rank", str(rank)])
    server.command = launch_command(str(cfg.python), servers.model_dir, server.port, cfg)
    server.env = server_env(cfg)
    server.env.pop("OMP_NUM_THREADS", None)
    server.spawn()


def start_lora_servers(servers: SGLangServers, attempts: int = 3) -> None:
    """Start every server and wait until all are healthy; one that dies or cannot bind
    its port (taken meanwhile) is started again on another port."""
    tries = dict.fromkeys(range(len(servers.servers)), 1)
    for index in tries:
        spawn_lora_server(servers, index)
    deadline = time.monotonic() + START_TIMEOUT_S
    waiting = set(tries)
    while waiting:
        assert time.monotonic() < deadline, "LoRA SGLang servers did not start in time"
        for index in sorted(waiting):
            server = servers.servers[index]
            if healthy(server.url):
                waiting.discard(index)
            elif "address already in use" in server.log_tail(4000) or not servers.alive(index):
                server.signal_group(signal.SIGKILL)
                if tries[index] >= attempts:
                    raise RuntimeError(f"LoRA SGLang server {index} failed:\n{server.log_tail()}")
                tries[index] += 1
                spawn_lora_server(servers, index)
        time.sleep(1.0)


@pytest.fixture(scope="module")
def sglang_lora_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServers]:
    """Two SGLang servers on smollm2-135m with `--enable-lora` (ranks: LORA_SERVER_RANKS).

    Always started here (`LIVELOOP_SGLANG_TEST_URLS` names servers without LoRA).
    """
    servers = SGLangServers(2, tmp_path_factory.mktemp("sglang-lora-logs"))
    try:
        start_lora_servers(servers)
        yield servers
    finally:
        servers.stop()

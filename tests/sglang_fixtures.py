"""Pytest plugin of the SGLang tests: two real SGLang servers on CPU for the whole session.

Loaded with `pytest_plugins = ["tests.sglang_fixtures"]`; its fixtures are only set up by
tests marked `sglang`, which `make test-sglang` runs (see tests/support/sglang.py).
`sglang_lora_servers` is a second pair, with SGLang's multi-LoRA enabled, for one module
at a time (tests that use it are also marked `sglang_launch`, which `make test-sglang`
runs apart from the session pair, so that at most two servers exist at a time).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from liveloop.config import SGLangConfig
from liveloop.server.engine.sglang.launcher import launch_command, server_env
from tests.support.sglang import SHIM_DIR, SGLangServers, cpu_config

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


@pytest.fixture(scope="module")
def sglang_lora_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServers]:
    """Two SGLang servers on smollm2-135m with `--enable-lora` (ranks: LORA_SERVER_RANKS)."""
    servers = SGLangServers(2, tmp_path_factory.mktemp("sglang-lora-logs"))
    for server, rank in zip(servers.servers, LORA_SERVER_RANKS, strict=True):
        cfg = lora_config(launch_args=[*LORA_CPU_ARGS, "--max-lora-rank", str(rank)])
        server.command = launch_command(str(cfg.python), servers.model_dir, server.port, cfg)
        server.env = server_env(cfg)
        server.env.pop("OMP_NUM_THREADS", None)
    try:  # always started here (LIVELOOP_SGLANG_TEST_URLS names servers without LoRA)
        servers.start()
        yield servers
    finally:
        servers.stop()

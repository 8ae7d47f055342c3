"""Shared fixtures (a real embedded Valkey on a free port, isolated data dirs) and the
polling helpers every test waits with: `wait_for` (async) and `wait_until` (blocking).

Tests wait for a condition, never for a fixed time, and the deadlines are generous: the
machine running them may be loaded.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import redis
import redis.asyncio as aredis

from liveloop.valkey import EmbeddedValkey
from tests.support.sglang import PYTHON_ENV, sglang_python

Check = Callable[[], bool | Awaitable[bool]]
T = TypeVar("T")


async def wait_for(
    check: Check, timeout_s: float = 15.0, interval_s: float = 0.02, what: str = "condition"
) -> None:
    """Poll `check` (a plain or an async predicate) until it holds; AssertionError at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s:g}s")
        await asyncio.sleep(interval_s)


def wait_until(
    check: Callable[[], T],
    timeout_s: float = 30.0,
    what: str = "condition",
    interval_s: float = 0.05,
) -> T:
    """Blocking `wait_for`, for tests that drive subprocesses: the check's first truthy value."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s:g}s")
        time.sleep(interval_s)
    return value


os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `sglang` need real SGLang servers: they run under `make test-sglang`."""
    if sglang_python() is not None:
        return
    skip = pytest.mark.skip(reason=f"needs SGLang: run `make test-sglang` (sets {PYTHON_ENV})")
    for item in items:
        if item.get_closest_marker("sglang") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def valkey_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedValkey]:
    """One real Valkey server for the whole test session."""
    server = EmbeddedValkey(tmp_path_factory.mktemp("valkey"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(valkey_server: EmbeddedValkey) -> Iterator[str]:
    """URL of a freshly emptied database on the shared Valkey server."""
    client = redis.Redis.from_url(valkey_server.url)
    client.flushdb()
    client.close()
    yield valkey_server.url


@pytest.fixture
async def aredis_client(redis_url: str) -> AsyncIterator[aredis.Redis]:
    """An async client (decoded responses) on the emptied database."""
    client = aredis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """An empty LiveLoop data dir."""
    path = tmp_path / "liveloop-data"
    path.mkdir()
    return path

"""Pytest plugin of the server tests: one real server subprocess shared by the whole session.

Test modules load it with `pytest_plugins = ["tests.server_fixtures"]`. The server runs
`liveloop serve --model tiny-random` with API keys (two plain ones, and two with tight
limits for the limit tests) and an admin key against the test
Valkey (its own logical database), so tests can read what it wrote with XRANGE.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import redis

from liveloop.server.api.auth import tenant_id
from liveloop.valkey import EmbeddedValkey
from tests.server_proc import ADMIN_KEY, API_KEYS, BUSY_KEY, RATE_KEY, ServerProcess, db_url

SERVER_DB = 9


@pytest.fixture(scope="session")
def liveloop_server(
    valkey_server: EmbeddedValkey, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The shared server (API keys `API_KEYS`, admin key `ADMIN_KEY`)."""
    url = db_url(valkey_server.url, SERVER_DB)
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    limits = {
        tenant_id(RATE_KEY): {"requests_per_minute": 6, "burst": 2},
        tenant_id(BUSY_KEY): {"concurrent_requests": 1},
    }
    env = {
        "LIVELOOP_API_KEYS": ",".join([*API_KEYS, RATE_KEY, BUSY_KEY]),
        "LIVELOOP_ADMIN_KEY": ADMIN_KEY,
        "LIVELOOP_SERVER__KEY_LIMITS": json.dumps(limits),
    }
    server = ServerProcess(url, tmp_path_factory.mktemp("server"), env=env)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def server_url(liveloop_server: ServerProcess) -> str:
    """Base URL of the shared server."""
    return liveloop_server.base_url


@pytest.fixture
def server_redis(liveloop_server: ServerProcess) -> Iterator[redis.Redis]:
    """A decoded client on the shared server's Redis database."""
    client = redis.Redis.from_url(liveloop_server.redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def client(server_url: str) -> Iterator[openai.OpenAI]:
    """The official sync client with the first API key."""
    with openai.OpenAI(base_url=server_url + "/v1", api_key=API_KEYS[0], max_retries=0) as c:
        yield c


@pytest.fixture
def other_client(server_url: str) -> Iterator[openai.OpenAI]:
    """The official sync client with the second API key (another tenant)."""
    with openai.OpenAI(base_url=server_url + "/v1", api_key=API_KEYS[1], max_retries=0) as c:
        yield c


@pytest.fixture
async def async_client(server_url: str) -> Any:
    """The official async client with the first API key."""
    async with openai.AsyncOpenAI(
        base_url=server_url + "/v1", api_key=API_KEYS[0], max_retries=0
    ) as c:
        yield c

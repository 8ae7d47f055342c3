"""Redis going away never fails or delays a reply; its turns reach the stream once it is back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from liveloop.valkey import EmbeddedValkey, free_port
from tests.server_proc import ServerProcess, metric_value, turns_of

HELLO: Any = [{"role": "user", "content": "hello"}]


@pytest.fixture
def own_valkey(tmp_path: Path) -> Iterator[EmbeddedValkey]:
    """A Valkey this test may stop and restart (same port, same data)."""
    server = EmbeddedValkey(tmp_path / "valkey-data", port=free_port())
    server.start()
    yield server
    server.stop()


@pytest.mark.slow
def test_replies_go_on_while_redis_is_down(own_valkey: EmbeddedValkey, tmp_path: Path) -> None:
    server = ServerProcess(own_valkey.url, tmp_path / "server").start()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        before = client.chat.completions.with_raw_response.create(
            model="tiny-random", messages=HELLO, max_tokens=3
        )
        own_valkey.stop()
        started = time.monotonic()
        during = client.chat.completions.with_raw_response.create(
            model="tiny-random", messages=HELLO, max_tokens=3
        )
        assert time.monotonic() - started < 3.0
        assert during.parse().choices[0].finish_reason == "length"
        down_sid = during.headers["x-session-id"]
        feedback = httpx.post(
            server.base_url + "/v1/feedback", json={"session_id": down_sid, "score": 1}
        )
        assert feedback.status_code == 503
        backlog = metric_value(
            httpx.get(server.base_url + "/metrics").text, "liveloop_trace_spool_backlog"
        )
        assert backlog is not None and backlog >= 1
        own_valkey.start()
        client_redis = redis.Redis.from_url(own_valkey.url, decode_responses=True)
        deadline = time.monotonic() + 30
        while not turns_of(client_redis, down_sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(turns_of(client_redis, down_sid)) == 1
        assert len(turns_of(client_redis, before.headers["x-session-id"])) == 1
        client_redis.close()
    finally:
        server.stop()

"""Who can call what, tenant isolation, what is never stored or shown, and per-key limits,
against the real server subprocess (keys from tests/server_proc.py)."""

from __future__ import annotations

import json
import socket
import time
import uuid
from typing import Any

import httpx
import openai
import pytest
import redis

from liveloop.config import ConfigError, load_settings
from liveloop.server.api.auth import tenant_id
from liveloop.server.limits import TenantLimiter
from tests.server_proc import (
    ADMIN_KEY,
    API_KEYS,
    BUSY_KEY,
    RATE_KEY,
    ServerProcess,
    wait_for_turns,
)

pytest_plugins = ["tests.server_fixtures"]

MODEL = "tiny-random"
HELLO: Any = [{"role": "user", "content": "hello"}]
SECRETS = (*API_KEYS, ADMIN_KEY, RATE_KEY, BUSY_KEY)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _chat(url: str, key: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
    headers = {**_auth(key), **(headers or {})}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers)


def test_admin_key_and_api_keys_open_only_their_own_routes(server_url: str) -> None:
    assert _chat(server_url, ADMIN_KEY).status_code == 401
    feedback = {"session_id": "s", "score": 1}
    response = httpx.post(server_url + "/v1/feedback", json=feedback, headers=_auth(ADMIN_KEY))
    assert response.status_code == 401
    for key in (API_KEYS[0], ""):
        response = httpx.get(server_url + "/admin/weights", headers=_auth(key))
        assert response.status_code == 401 and response.json()["error"]["type"]
    assert httpx.get(server_url + "/admin/weights", headers=_auth(ADMIN_KEY)).status_code == 200
    assert _chat(server_url, API_KEYS[0]).status_code == 200


def test_the_admin_key_cannot_also_be_an_api_key() -> None:
    with pytest.raises(ConfigError, match="admin_key must differ") as info:
        load_settings(api_keys="sk-a,sk-b", admin_key="sk-b")
    assert "sk-b" not in str(info.value)  # the error names the setting, not the secret


def test_no_route_reads_sessions_or_changes_settings(server_url: str) -> None:
    schema = httpx.get(server_url + "/openapi.json").json()
    operations = {(m.upper(), p) for p, item in schema["paths"].items() for m in item}
    assert operations == {
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/{model_id}"),
        ("POST", "/v1/feedback"),
        ("GET", "/admin/weights"),
        ("POST", "/admin/weights"),
        ("DELETE", "/admin/adapters/{name}"),
        ("DELETE", "/admin/tenants/{key_id}"),
        ("GET", "/admin/capture"),
        ("POST", "/admin/capture/pause"),
        ("POST", "/admin/capture/resume"),
        ("GET", "/healthz"),
        ("GET", "/readyz"),
        ("GET", "/metrics"),
    }
    # the only admin body names a checkpoint (or one adapter) to load; nothing takes a setting
    schemas = schema["components"]["schemas"]
    loaded = set(schemas["LoadWeightsRequest"]["properties"])
    assert loaded == {"path", "version", "adapter", "tenant"}
    for method in ("put", "patch", "post"):
        response = httpx.request(method, server_url + "/admin/config", headers=_auth(ADMIN_KEY))
        assert response.status_code in (404, 405)


def test_another_tenant_cannot_continue_join_or_rate_a_session(
    client: openai.OpenAI, other_client: openai.OpenAI, server_url: str
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=3, temperature=0
    )
    sid, reply = raw.headers["x-session-id"], raw.parse().choices[0].message
    follow: Any = [*HELLO, {"role": "assistant", "content": reply.content}, *HELLO]
    # with the session id, in the header or the body
    with pytest.raises(openai.PermissionDeniedError):
        other_client.chat.completions.create(
            model=MODEL, messages=follow, max_tokens=2, extra_headers={"X-Session-Id": sid}
        )
    with pytest.raises(openai.PermissionDeniedError):
        other_client.chat.completions.create(
            model=MODEL, messages=follow, max_tokens=2, metadata={"session_id": sid}
        )
    # by sending the same conversation: a session of its own, not a link to the other's
    joined = other_client.chat.completions.with_raw_response.create(
        model=MODEL, messages=follow, max_tokens=2
    )
    assert joined.headers["x-session-id"] != sid and joined.headers["x-turn-index"] == "0"
    mine = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=follow, max_tokens=2
    )
    assert mine.headers["x-session-id"] == sid  # the owner does join it
    rated = httpx.post(
        server_url + "/v1/feedback",
        json={"session_id": sid, "score": 1},
        headers=_auth(API_KEYS[1]),
    )
    assert rated.status_code == 403 and rated.json()["error"]["code"] == "session_forbidden"


def _everything_in_redis(client: redis.Redis) -> str:
    """Every key and every value of the database, as one text."""
    parts = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        parts.append(str(key))
        if kind == "string":
            parts.append(str(client.get(key)))
        elif kind == "hash":
            parts.append(json.dumps(client.hgetall(key)))
        elif kind == "stream":
            parts.append(json.dumps(client.xrange(key)))
        elif kind == "set":
            parts.append(json.dumps(sorted(client.smembers(key))))  # type: ignore[arg-type]
        elif kind == "zset":
            parts.append(json.dumps(client.zrange(key, 0, -1)))
    return "\n".join(parts)


def test_opted_out_requests_leave_no_trace(
    server_url: str, server_redis: redis.Redis, liveloop_server: ServerProcess
) -> None:
    marker = "optout-" + uuid.uuid4().hex
    headers = {**_auth(API_KEYS[0]), "X-LiveLoop-Train": "false", "X-Session-Id": marker}
    for stream in (False, True):
        response = httpx.post(
            server_url + "/v1/chat/completions",
            headers=headers,
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": f"secret {marker}"}],
                "max_tokens": 3,
                "stream": stream,
            },
        )
        assert response.status_code == 200
    # A recorded request after them: once its record is in the stream, anything written
    # for the earlier ones (the writer keeps order) would be there too.
    after = "after-" + uuid.uuid4().hex
    assert _chat(server_url, API_KEYS[0], headers={"X-Session-Id": after}).status_code == 200
    assert len(wait_for_turns(server_redis, after, 1)) == 1
    assert marker not in _everything_in_redis(server_redis)
    assert marker not in httpx.get(server_url + "/metrics").text
    assert marker not in liveloop_server.log_path.read_text(errors="replace")


def test_keys_never_appear_in_errors_metrics_logs_or_redis(
    server_url: str, server_redis: redis.Redis, liveloop_server: ServerProcess
) -> None:
    wrong = "sk-wrong-" + uuid.uuid4().hex
    for key in (wrong, ADMIN_KEY):
        response = _chat(server_url, key)
        assert response.status_code == 401
        assert key not in response.text and "incorrect API key" in response.text
    response = httpx.get(server_url + "/admin/weights", headers=_auth(wrong))
    assert response.status_code == 401 and wrong not in response.text
    assert _chat(server_url, API_KEYS[0]).status_code == 200
    texts = {
        "metrics": httpx.get(server_url + "/metrics").text,
        "log": liveloop_server.log_path.read_text(errors="replace"),
        "redis": _everything_in_redis(server_redis),
    }
    for where, text in texts.items():
        for secret in (*SECRETS, wrong):
            assert secret not in text, (where, secret[:8])
    assert tenant_id(API_KEYS[0]) in texts["redis"]  # records name the key's id instead


def test_oversized_headers_get_431(server_url: str) -> None:
    response = _chat(server_url, API_KEYS[0], headers={"x-pad": "p" * 40_000})
    assert response.status_code == 431
    assert response.json()["error"]["code"] == "request_header_fields_too_large"
    assert _chat(server_url, API_KEYS[0]).status_code == 200


def test_a_key_over_its_rate_gets_429_with_retry_after(
    server_url: str, client: openai.OpenAI
) -> None:
    statuses = [_chat(server_url, RATE_KEY) for _ in range(3)]
    assert [r.status_code for r in statuses] == [200, 200, 429]  # a burst of 2
    refused = statuses[2]
    assert 1 <= int(refused.headers["retry-after"]) <= 10  # one request every 10 s
    assert refused.json()["error"] == {
        "message": "rate limit reached: 6 requests per minute",
        "type": "rate_limit_error",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    limited = openai.OpenAI(base_url=server_url + "/v1", api_key=RATE_KEY, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        limited.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    # other keys are not affected
    assert client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2).choices
    assert (
        'liveloop_requests_limited_total{reason="rate"}' in httpx.get(server_url + "/metrics").text
    )


def test_a_key_over_its_concurrency_gets_429_until_its_request_ends(server_url: str) -> None:
    """A request is in flight from its head on: one whose body is still coming holds the
    key's only slot, deterministically, until the rest of the body arrives."""
    host, port = server_url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "messages": HELLO, "max_tokens": 2}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as held:
        held.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {BUSY_KEY}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body[:10]
        )
        busy = _wait_for_status(server_url, BUSY_KEY, 429)
        assert busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["code"] == "concurrency_limit_exceeded"
        assert _chat(server_url, API_KEYS[0]).status_code == 200  # others go on
        held.sendall(body[10:])
        assert held.recv(64).startswith(b"HTTP/1.1 200")
    assert _wait_for_status(server_url, BUSY_KEY, 200).status_code == 200  # its slot is back


def _wait_for_status(url: str, key: str, status: int, timeout_s: float = 10.0) -> httpx.Response:
    """Chat requests until one gets `status` (the server may take a moment to see the other)."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = _chat(url, key)
        if response.status_code == status or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def test_token_bucket_and_in_flight_counts() -> None:
    from liveloop.config.server import KeyLimits

    limiter = TenantLimiter(
        KeyLimits(requests_per_minute=60, burst=2, concurrent_requests=0),
        {"key-vip": KeyLimits(requests_per_minute=0, concurrent_requests=2)},
    )
    assert limiter.acquire("a", now=0.0) is None
    assert limiter.acquire("a", now=0.0) is None
    reason, retry = limiter.acquire("a", now=0.0) or ("", 0.0)
    assert reason == "rate" and retry == pytest.approx(1.0)  # one token a second
    assert limiter.acquire("a", now=0.5) is not None
    assert limiter.acquire("a", now=1.0) is None  # refilled
    assert limiter.acquire("b", now=1.0) is None  # every key its own bucket
    assert limiter.acquire("key-vip") is None and limiter.acquire("key-vip") is None
    assert limiter.acquire("key-vip") == ("concurrency", 1.0)
    limiter.release("key-vip")
    assert limiter.acquire("key-vip") is None


def test_key_id_prints_the_tenant_of_each_key_read_from_stdin() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "liveloop.cli", "key-id"],
        input=f"{API_KEYS[0]}\n\n{API_KEYS[1]}\n",
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == [tenant_id(API_KEYS[0]), tenant_id(API_KEYS[1])]
    assert API_KEYS[0] not in out.stdout + out.stderr

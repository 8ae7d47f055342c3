"""Bad input, auth, body limits and client disconnects: clear 4xx in OpenAI's error shape."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from tests.server_proc import ADMIN_KEY, API_KEYS, metric_value, turns_of

pytest_plugins = ["tests.server_fixtures"]

AUTH = {"Authorization": f"Bearer {API_KEYS[0]}"}
USER: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]


def _post(url: str, body: Any = None, **kw: Any) -> httpx.Response:
    headers = {**AUTH, **kw.pop("headers", {})}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30, **kw)


def _body(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny-random", "messages": USER, "max_tokens": 2, **fields}


def _assert_error(resp: httpx.Response, status: int, *words: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error
    return dict(error)


BAD_BODIES: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("missing messages", {"model": "tiny-random"}, ("messages",)),
    ("empty messages", _body(messages=[]), ("messages",)),
    ("unknown role", _body(messages=[{"role": "wizard", "content": "x"}]), ("wizard",)),
    ("content not text", _body(messages=[{"role": "user", "content": 123}]), ("content",)),
    (
        "image content",
        _body(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        ),
        ("image_url",),
    ),
    (
        "tool message without id",
        _body(messages=[{"role": "tool", "content": "x"}]),
        ("tool_call_id",),
    ),
    ("negative max_tokens", _body(max_tokens=-1), ("max_tokens",)),
    ("max_tokens over limit", _body(max_tokens=100_000), ("max_tokens", "limit")),
    ("max_completion_tokens zero", _body(max_completion_tokens=0), ("max_completion_tokens",)),
    ("temperature too high", _body(temperature=2.5), ("temperature",)),
    ("negative top_p", _body(top_p=-0.1), ("top_p",)),
    ("n zero", _body(n=0), ("n",)),
    ("n too big", _body(n=1000), ("n",)),
    ("top_logprobs without logprobs", _body(top_logprobs=2), ("logprobs",)),
    ("too many stops", _body(stop=["a", "b", "c", "d", "e"]), ("stop",)),
    ("tool_choice without tools", _body(tool_choice="required"), ("tool_choice",)),
    ("unknown tool_choice", _body(tool_choice="sometimes"), ("tool_choice",)),
    (
        "named tool not offered",
        _body(
            tools=[
                {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}
            ],
            tool_choice={"type": "function", "function": {"name": "b"}},
        ),
        ("'b'",),
    ),
    (
        "schema the grammar rejects",
        _body(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}},
                },
            }
        ),
        (),
    ),
]


@pytest.mark.parametrize(("name", "body", "words"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_input_is_a_clear_400(
    server_url: str, name: str, body: dict[str, Any], words: tuple[str, ...]
) -> None:
    error = _assert_error(_post(server_url, body), 400, *words)
    assert error["type"] == "invalid_request_error"


def test_malformed_json_and_non_object_body(server_url: str) -> None:
    headers = {**AUTH, "Content-Type": "application/json"}
    resp = httpx.post(server_url + "/v1/chat/completions", content=b'{"model": ', headers=headers)
    _assert_error(resp, 400, "JSON")
    resp = httpx.post(server_url + "/v1/chat/completions", content=b"[1, 2]", headers=headers)
    _assert_error(resp, 400)


def test_context_window_unknown_model_and_bad_headers(server_url: str) -> None:
    long = [{"role": "user", "content": "word " * 5000}]
    error = _assert_error(_post(server_url, _body(messages=long)), 400, "context window")
    assert error["code"] == "context_length_exceeded"
    error = _assert_error(_post(server_url, _body(model="gpt-4o")), 404, "gpt-4o")
    assert error["code"] == "model_not_found"
    _assert_error(_post(server_url, _body(), headers={"X-Turn-Type": "bonus"}), 400, "X-Turn-Type")
    _assert_error(_post(server_url, _body(), headers={"X-LiveLoop-Train": "maybe"}), 400)
    _assert_error(_post(server_url, _body(), headers={"X-Session-Id": "bad id!"}), 400, "session")


def test_auth(server_url: str) -> None:
    url = server_url + "/v1/chat/completions"
    _assert_error(httpx.post(url, json=_body()), 401, "API key")
    wrong = {"Authorization": "Bearer sk-wrong"}
    error = _assert_error(httpx.post(url, json=_body(), headers=wrong), 401)
    assert error["code"] == "invalid_api_key"
    _assert_error(httpx.get(server_url + "/v1/models", headers=wrong), 401)
    assert httpx.get(server_url + "/v1/models", headers=AUTH).status_code == 200
    _assert_error(httpx.get(server_url + "/admin/weights", headers=AUTH), 401, "admin")
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.get(server_url + "/admin/weights", headers=admin).status_code == 200
    for open_path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(server_url + open_path).status_code == 200


def test_body_size_limit(server_url: str) -> None:
    big = _body(messages=[{"role": "user", "content": "x" * (9 * 1024 * 1024)}])
    _assert_error(_post(server_url, big), 413, "limit")

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny-random", "messages": [{"role": "user", "content": "'
        for _ in range(9):
            yield b"y" * (1024 * 1024)
        yield b'"}]}'

    headers = {**AUTH, "Content-Type": "application/json"}
    resp = httpx.post(server_url + "/v1/chat/completions", content=chunks(), headers=headers)
    _assert_error(resp, 413)


def _running(server_url: str) -> float:
    text = httpx.get(server_url + "/metrics").text
    value = metric_value(text, "liveloop_requests_running")
    assert value is not None
    return value


def test_client_disconnect_frees_the_engine_slot(
    server_url: str, server_redis: redis.Redis
) -> None:
    body = _body(max_tokens=1500, stream=True, seed=1)
    with httpx.stream("POST", server_url + "/v1/chat/completions", json=body, headers=AUTH) as resp:
        sid = resp.headers["x-session-id"]
        lines = resp.iter_lines()
        for _ in range(6):
            next(lines)
        assert _running(server_url) >= 1
    deadline = time.monotonic() + 5
    while _running(server_url) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(server_url) == 0
    while not turns_of(server_redis, sid) and time.monotonic() < deadline:
        time.sleep(0.05)
    (record,) = turns_of(server_redis, sid)
    assert record["finish_reason"] == "abort"
    assert 0 < len(record["completion_token_ids"]) < 1500

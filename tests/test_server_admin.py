"""Admin routes: weights served and loaded through the server, trace capture pause/resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import redis

from tests.server_proc import ADMIN_KEY, model_dir, turns_of, wait_for_turns

pytest_plugins = ["tests.server_fixtures"]

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
HELLO: Any = [{"role": "user", "content": "hello"}]


def _weights(server_url: str) -> dict[str, Any]:
    resp = httpx.get(server_url + "/admin/weights", headers=ADMIN)
    assert resp.status_code == 200
    return dict(resp.json())


def test_load_weights_swaps_the_served_version(
    server_url: str, client: openai.OpenAI, server_redis: redis.Redis
) -> None:
    before = _weights(server_url)["version"]
    checkpoint = str(model_dir() / "model.safetensors")
    resp = httpx.post(
        server_url + "/admin/weights", json={"path": checkpoint}, headers=ADMIN, timeout=60
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["version"] == before + 1
    state = _weights(server_url)
    assert state["version"] == before + 1
    assert (
        state["history"][-1]["version"] == before + 1 and state["history"][-1]["path"] == checkpoint
    )
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-random", messages=HELLO, max_tokens=3
    )
    assert raw.headers["x-policy-version"] == str(before + 1)
    (record,) = wait_for_turns(server_redis, raw.headers["x-session-id"], 1)
    assert record["versions"] == [before + 1] * 3


def test_bad_checkpoints_are_refused_and_serving_goes_on(
    server_url: str, client: openai.OpenAI, tmp_path: Path
) -> None:
    before = _weights(server_url)["version"]
    garbage = tmp_path / "broken.safetensors"
    garbage.write_bytes(b"\x00not a safetensors file")
    for path in (str(tmp_path / "missing"), str(garbage)):
        resp = httpx.post(server_url + "/admin/weights", json={"path": path}, headers=ADMIN)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == "invalid_checkpoint"
    assert _weights(server_url)["version"] == before
    reply = client.chat.completions.create(model="tiny-random", messages=HELLO, max_tokens=2)
    assert reply.choices[0].finish_reason == "length"


def test_operator_can_roll_back_to_an_older_version(server_url: str, client: openai.OpenAI) -> None:
    before = _weights(server_url)["version"]
    ahead = httpx.post(
        server_url + "/admin/weights",
        json={"path": str(model_dir()), "version": before + 5},
        headers=ADMIN,
    )
    assert ahead.status_code == 200, ahead.text
    back = httpx.post(
        server_url + "/admin/weights",
        json={"path": str(model_dir()), "version": before},
        headers=ADMIN,
    )
    assert back.status_code == 200, back.text
    assert _weights(server_url)["version"] == before
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-random", messages=HELLO, max_tokens=2
    )
    assert raw.headers["x-policy-version"] == str(before)


def test_capture_pause_and_resume(
    server_url: str, client: openai.OpenAI, server_redis: redis.Redis
) -> None:
    def chat() -> str:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-random", messages=HELLO, max_tokens=2
        )
        return str(raw.headers["x-session-id"])

    paused = httpx.post(server_url + "/admin/capture/pause", headers=ADMIN)
    try:
        assert paused.json() == {"capture": False}
        assert httpx.get(server_url + "/admin/capture", headers=ADMIN).json() == {"capture": False}
        unrecorded = chat()
    finally:
        resumed = httpx.post(server_url + "/admin/capture/resume", headers=ADMIN)
    assert resumed.json() == {"capture": True}
    recorded = chat()
    assert len(wait_for_turns(server_redis, recorded, 1)) == 1
    assert turns_of(server_redis, unrecorded) == []

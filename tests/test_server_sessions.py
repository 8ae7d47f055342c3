"""Sessions, token-exact prompt extension, recording opt-outs, tenancy and feedback."""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx
import openai
import pytest
import redis

from tests.server_proc import API_KEYS, tenant_of, turns_of, wait_for_turns

pytest_plugins = ["tests.server_fixtures"]

MODEL = "tiny-random"


def _chat(client: openai.OpenAI, messages: Any, **kw: Any) -> Any:
    return client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=kw.pop("max_tokens", 6), seed=7, **kw
    )


def test_multi_turn_session_extends_prompt_token_exactly(
    client: openai.OpenAI, server_redis: redis.Redis
) -> None:
    history: Any = [{"role": "user", "content": "Plan a trip."}]
    sessions, replies = [], []
    for turn in range(3):
        raw = _chat(client, history)
        reply = raw.parse()
        sessions.append(raw.headers["x-session-id"])
        assert raw.headers["x-turn-index"] == str(turn)
        replies.append(reply.choices[0].message)
        history += [
            reply.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": f"And then {turn}?"},
        ]
    assert len(set(sessions)) == 1, "follow-ups must join the first turn's session"
    records = wait_for_turns(server_redis, sessions[0], 3)
    assert [r["turn_index"] for r in records] == [0, 1, 2]
    assert [r["prompt_mode"] for r in records] == ["fresh", "extended", "extended"]
    for prev, cur in itertools.pairwise(records):
        served = prev["prompt_token_ids"] + prev["completion_token_ids"]
        assert cur["prompt_token_ids"][: len(served)] == served
        assert len(cur["prompt_token_ids"]) > len(served)
        assert cur["messages"][: len(prev["messages"])] == prev["messages"]


def test_a_different_history_starts_a_new_session(client: openai.OpenAI) -> None:
    first = _chat(client, [{"role": "user", "content": "Topic A"}])
    forged: Any = [
        {"role": "user", "content": "Topic A"},
        {"role": "assistant", "content": "not what the model said"},
        {"role": "user", "content": "go on"},
    ]
    second = _chat(client, forged)
    assert second.headers["x-session-id"] != first.headers["x-session-id"]
    assert second.headers["x-turn-index"] == "0"


def test_explicit_session_header_and_metadata(
    client: openai.OpenAI, server_redis: redis.Redis
) -> None:
    sid = "agent-run-42"
    for i, text in enumerate(["one", "two"]):
        raw = _chat(
            client, [{"role": "user", "content": text}], extra_headers={"X-Session-Id": sid}
        )
        assert raw.headers["x-session-id"] == sid and raw.headers["x-turn-index"] == str(i)
    raw = _chat(client, [{"role": "user", "content": "three"}], metadata={"session_id": sid})
    assert raw.headers["x-session-id"] == sid and raw.headers["x-turn-index"] == "2"
    records = wait_for_turns(server_redis, sid, 3)
    assert [r["turn_index"] for r in records] == [0, 1, 2]
    assert all(r["prompt_mode"] == "fresh" for r in records)


def test_side_turns_and_unrecorded_requests(
    client: openai.OpenAI, server_redis: redis.Redis
) -> None:
    side = _chat(
        client, [{"role": "user", "content": "title?"}], extra_headers={"X-Turn-Type": "side"}
    )
    sid = side.headers["x-session-id"]
    assert [r["turn_type"] for r in wait_for_turns(server_redis, sid, 1)] == ["side"]
    off = _chat(
        client,
        [{"role": "user", "content": "private"}],
        extra_headers={"X-LiveLoop-Train": "false"},
    )
    off_sid = off.headers["x-session-id"]
    assert off_sid and int(off.headers["x-policy-version"]) >= 0
    wait_for_turns(server_redis, sid, 2, timeout_s=1.0)  # give the writer time
    assert turns_of(server_redis, off_sid) == []
    assert server_redis.exists(f"liveloop:session:{off_sid}") == 0


def test_sessions_belong_to_their_tenant(
    client: openai.OpenAI, other_client: openai.OpenAI, server_url: str, server_redis: redis.Redis
) -> None:
    raw = _chat(client, [{"role": "user", "content": "mine"}])
    sid = raw.headers["x-session-id"]
    with pytest.raises(openai.PermissionDeniedError):
        _chat(other_client, [{"role": "user", "content": "x"}], extra_headers={"X-Session-Id": sid})
    assert wait_for_turns(server_redis, sid, 1)[0]["tenant"] == tenant_of(API_KEYS[0])

    def feedback(key: str, body: dict[str, Any]) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"}
        return httpx.post(server_url + "/v1/feedback", json=body, headers=headers)

    assert feedback(API_KEYS[1], {"session_id": sid, "score": 1}).status_code == 403
    missing = feedback(API_KEYS[0], {"session_id": "sess-nope", "score": 1})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "session_not_found"
    assert (
        feedback(API_KEYS[0], {"session_id": sid, "turn_index": 5, "score": 1}).status_code == 404
    )
    assert feedback(API_KEYS[0], {"session_id": sid, "score": 2}).status_code == 400
    ok = feedback(API_KEYS[0], {"session_id": sid, "score": -0.5, "comment": "meh"})
    assert ok.status_code == 200 and ok.json()["turn_index"] == 0
    entries: Any = server_redis.xrange("liveloop:feedback")
    mine = [
        json.loads(f["data"]) for _id, f in entries if json.loads(f["data"])["session_id"] == sid
    ]
    assert len(mine) == 1
    assert mine[0]["score"] == -0.5 and mine[0]["comment"] == "meh"
    assert mine[0]["tenant"] == tenant_of(API_KEYS[0]) and mine[0]["turn_index"] == 0

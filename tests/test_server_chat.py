"""Chat completions through the official openai client against the real server subprocess."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import openai
import pytest
import redis

from tests.server_proc import API_KEYS, metric_value, tenant_of, wait_for_turns

pytest_plugins = ["tests.server_fixtures"]

MODEL = "tiny-random"
HELLO: Any = [{"role": "user", "content": "Say hello."}]


def test_non_streaming_reply_usage_and_headers(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=6, temperature=0
    )
    reply = raw.parse()
    assert raw.headers["x-session-id"].startswith("sess-")
    assert int(raw.headers["x-policy-version"]) >= 0
    assert reply.object == "chat.completion" and reply.model == MODEL
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 6
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 6


def test_greedy_and_seeded_sampling_are_reproducible(client: openai.OpenAI) -> None:
    def ask(**kw: Any) -> str | None:
        out = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, **kw)
        return out.choices[0].message.content

    assert ask(temperature=0) == ask(temperature=0)
    assert ask(temperature=1.0, seed=11) == ask(temperature=1.0, seed=11)


def test_stream_is_token_by_token_and_matches_non_streamed(client: openai.OpenAI) -> None:
    kw: Any = {"model": MODEL, "messages": HELLO, "max_tokens": 12, "seed": 21}
    full = client.chat.completions.create(**kw).choices[0].message.content
    stream = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    pieces, arrivals, finish, usage = [], [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
                arrivals.append(time.perf_counter())
            finish = choice.finish_reason or finish
    assert "".join(pieces) == full
    assert len(pieces) >= 6  # one chunk per token (a few tokens may merge into one character)
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 12


def http_chunks(server_url: str, body: dict[str, Any]) -> list[bytes]:
    """POST with a plain socket and return the response's HTTP chunks as the server wrote
    them (chunked encoding keeps each write's boundaries, whatever TCP does)."""
    host, port = server_url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {API_KEYS[0]}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + payload)
        stream = sock.makefile("rb")
        assert stream.readline().split()[1] == b"200"
        while stream.readline() != b"\r\n":  # headers
            pass
        chunks = []
        while size := int(stream.readline().strip(), 16):
            chunks.append(stream.read(size))
            stream.readline()
    return chunks


def test_stream_writes_role_with_first_token_and_usage_with_done(server_url: str) -> None:
    """The client is woken once for the role and the first token, and once at the end."""
    body = {
        "model": MODEL, "messages": HELLO, "max_tokens": 6, "seed": 3, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip
    chunks = http_chunks(server_url, body)
    events = [
        [json.loads(e[6:]) for e in c.split(b"\n\n") if e.startswith(b"data: {")] for c in chunks
    ]
    first = events[0]
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "content" in first[1]["choices"][0]["delta"]
    assert chunks[-1].endswith(b"data: [DONE]\n\n")
    assert events[-1][-1]["usage"]["completion_tokens"] == 6
    finish = [c["finish_reason"] for e in events for x in e for c in x["choices"]]
    assert finish.count("length") == 1
    assert len(chunks) <= 6 + 1  # one write per token; role, finish and usage ride along


def test_n_samples_and_logprobs_are_recorded(
    client: openai.OpenAI, server_redis: redis.Redis
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=5, n=2, seed=3, logprobs=True, top_logprobs=3
    )
    reply = raw.parse()
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert len(choice.logprobs.content) == 5
        for entry in choice.logprobs.content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
    records = wait_for_turns(server_redis, raw.headers["x-session-id"], 2)
    assert sorted(r["sample_index"] for r in records) == [0, 1]
    for record in records:
        choice = reply.choices[record["sample_index"]]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert record["logprobs"] == pytest.approx([e.logprob for e in choice.logprobs.content])
        assert len(record["completion_token_ids"]) == len(record["versions"]) == 5
        assert record["tenant"] == tenant_of(API_KEYS[0])
        assert record["turn_index"] == 0 and record["turn_type"] == "main"
        assert record["response"]["content"] == choice.message.content
        assert record["timings"]["total_s"] >= record["timings"]["time_to_first_token_s"] > 0


def test_stop_string_cuts_the_reply(client: openai.OpenAI) -> None:
    kw: Any = {"model": MODEL, "messages": HELLO, "max_tokens": 16, "seed": 8}
    full = client.chat.completions.create(**kw).choices[0].message.content or ""
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"reply too short to pick a stop string from: {full!r}"
    cut = client.chat.completions.create(**kw, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[: full.index(stop)]
    streamed = client.chat.completions.create(**kw, stop=stop, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == full[: full.index(stop)]


async def test_async_client_streams_n_samples(async_client: openai.AsyncOpenAI) -> None:
    stream = await async_client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=4,
        n=2,
        stream=True,
        seed=5,
        logprobs=True,
        top_logprobs=2,
    )
    texts = {0: "", 1: ""}
    finishes = {}
    logprobs: dict[int, list[Any]] = {0: [], 1: []}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs and choice.logprobs.content:
                logprobs[choice.index] += choice.logprobs.content
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length"}
    assert all(texts.values())
    for entries in logprobs.values():
        assert len(entries) == 4 and all(len(e.top_logprobs) == 2 for e in entries)


def test_models_list_and_alias(client: openai.OpenAI, server_url: str) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=2)
    assert err.value.code == "model_not_found"
    assert httpx.get(server_url + "/healthz").json() == {"status": "ok"}


WEATHER: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


def test_required_tool_call_and_tool_result_continue(client: openai.OpenAI) -> None:
    ask: Any = [{"role": "user", "content": "Weather in Oslo?"}]
    reply = client.chat.completions.create(
        model=MODEL, messages=ask, tools=WEATHER, tool_choice="required", max_tokens=256, seed=1
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    call: Any = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    follow: Any = [
        *ask,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 3}'},
    ]
    again = client.chat.completions.create(
        model=MODEL, messages=follow, tools=WEATHER, tool_choice="none", max_tokens=4
    )
    assert again.choices[0].finish_reason == "length"
    assert again.choices[0].message.tool_calls is None


def test_named_tool_choice_streams_tool_call_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=WEATHER,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
        stream=True,
        seed=2,
    )
    names, arguments, finish = [], "", None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                if delta.function and delta.function.name:
                    names.append(delta.function.name)
                if delta.function and delta.function.arguments:
                    arguments += delta.function.arguments
            finish = choice.finish_reason or finish
    assert names == ["get_weather"]
    assert json.loads(arguments)["city"] in ("Paris", "Oslo")
    assert finish == "tool_calls"


def test_json_schema_response_format_is_valid_json(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=64,
        seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
    )
    value = json.loads(reply.choices[0].message.content or "")
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)
    assert reply.choices[0].finish_reason == "stop"
    obj = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=64, seed=4, response_format={"type": "json_object"}
    )
    assert obj.choices[0].finish_reason in ("stop", "length")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)


def test_metrics_exposition(client: openai.OpenAI, server_url: str) -> None:
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
    text = httpx.get(server_url + "/metrics").text
    for name in (
        "liveloop_time_to_first_token_seconds_count",
        "liveloop_inter_token_latency_seconds_count",
        "liveloop_e2e_request_latency_seconds_count",
        "liveloop_prompt_tokens_total",
        "liveloop_completion_tokens_total",
    ):
        value = metric_value(text, name)
        assert value is not None and value > 0, name
    for name in (
        "liveloop_requests_running",
        "liveloop_requests_queued",
        "liveloop_policy_version",
        "liveloop_trace_spool_backlog",
        "liveloop_trace_capture_enabled",
    ):
        assert metric_value(text, name) is not None, name
    assert "liveloop_trace_write_seconds_bucket" in text
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HELLO, max_tokens=1)
    text = httpx.get(server_url + "/metrics").text
    assert 'liveloop_errors_total{type="model_not_found"}' in text

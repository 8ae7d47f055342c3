"""A reply cut by `max_tokens` inside a tool call: no markup leaks into content, and the
finish reason is "length" (as OpenAI reports it), streamed or not, in the reply and the record.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import redis

from liveloop.server.tools import StreamingToolCallParser, parse_tool_calls
from tests.server_proc import wait_for_turns

pytest_plugins = ["tests.server_fixtures"]

MODEL = "tiny-random"
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                "required": ["city"],
            },
        },
    }
]
ASK: Any = [{"role": "user", "content": "Weather in Paris and Oslo?"}]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (f"{CALL}\n<tool", None, 1),  # the reported case: cut in the second call's tag
        (f'{CALL}\n<tool_call>\n{{"name": "get_t', None, 1),
        ("Let me look.\n<tool_call>\n{", "Let me look.\n", 0),
        ("Sure <tool_ca", "Sure ", 0),
        ('<tool_call>{"name": "get_time", "arguments": {}}', None, 1),  # only the tag is missing
        ("<tool_call>{bad}</tool_call> <to", "<tool_call>{bad}</tool_call> ", 0),
    ],
)
def test_truncated_call_markup_is_dropped(text: str, content: str | None, calls: int) -> None:
    parsed_content, parsed_calls = parse_tool_calls(text, truncated=True)
    assert (parsed_content, len(parsed_calls)) == (content, calls)
    parser = StreamingToolCallParser()
    deltas = [d for ch in text for d in parser.feed(ch)] + parser.finish(truncated=True)
    streamed = "".join(d.get("content", "") for d in deltas)
    assert streamed == (content or "")
    assert sum(len(d.get("tool_calls", [])) for d in deltas) == calls
    # not truncated, the unfinished markup is what the model wrote: it stays content
    if calls == 0:
        assert parse_tool_calls(text)[0] == text


def _two_call_seed(client: openai.OpenAI) -> tuple[int, int, int]:
    """A seed whose reply holds two or more calls: (seed, completion tokens, calls)."""
    for seed in range(40):
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=160,
            seed=seed, temperature=1.0,
        )  # fmt: skip
        choice = reply.choices[0]
        calls = choice.message.tool_calls or []
        if choice.finish_reason == "tool_calls" and len(calls) >= 2 and reply.usage:
            return seed, reply.usage.completion_tokens, len(calls)
    pytest.fail("no seed in 0..39 made tiny-random call the tool twice")


def test_reply_cut_inside_a_second_call(client: openai.OpenAI, server_redis: redis.Redis) -> None:
    seed, tokens, n_calls = _two_call_seed(client)
    kwargs: Any = dict(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=seed,
        temperature=1.0, max_tokens=tokens - 3,
    )  # fmt: skip
    raw = client.chat.completions.with_raw_response.create(**kwargs)
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "length"
    assert "<tool" not in (choice.message.content or "")
    complete = choice.message.tool_calls or []
    assert len(complete) == n_calls - 1
    for call in complete:
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    (record,) = wait_for_turns(server_redis, raw.headers["x-session-id"], 1)
    assert record["finish_reason"] == "length"
    assert "<tool" not in (record["response"].get("content") or "")

    content, names, finish = "", [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            names += [d.function.name for d in c.delta.tool_calls or [] if d.function]
            finish = c.finish_reason or finish
    assert finish == "length"
    assert "<tool" not in content
    assert len(names) == n_calls - 1

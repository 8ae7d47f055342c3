"""Tool calls written as fenced or bare JSON (what instruct models write besides tags).

Property tests (hypothesis) of the parser with offered tools: the streamed result equals the
batch result for every split, text without a call comes back exactly, a call in any of the
four forms is found with its arguments, JSON that does not name an offered function with
its required arguments is never a call, and a call cut short never leaks into content. Then
replies Qwen2.5-Coder-0.5B wrote when offered tools (`bench/tool_forms.py`), read as recorded.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from liveloop.server.tools import StreamingToolCallParser, parse_tool_calls
from liveloop.server.tools.format import format_call
from liveloop.server.tools.spec import ToolSpec, parse_tools

FAST = settings(
    max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None
)

TOOLS: list[ToolSpec] = parse_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["city"],
                },
            },
        },
        {"type": "function", "function": {"name": "get_time"}},
    ]
)
OFFERED = [tool.name for tool in TOOLS]

CALL_JSON = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
PIECES = st.sampled_from(
    ["```", "```json", "```python", "`", "\n", "  ", "{", "}", "[", "]", ",", ":", '"name"',
     '"get_weather"', '"get_time"', '"other"', '"arguments"', '"parameters"', '{"city": "Oslo"}',
     "{}", '"', "\\", "hi", "é", CALL_JSON, '{"name": "get_time"}', "<tool_call>", "</tool_call>",
     "<name>", "</name>", "get_weather", "<arguments>", "</arguments>", "<na", "</argu"]
)  # fmt: skip
MODEL_TEXT = st.one_of(st.lists(PIECES, max_size=30).map("".join), st.text(max_size=80))
LINE = st.text("abc .!?é", max_size=12)
ARGS = st.fixed_dictionaries(
    {"city": st.text("Osl é\"\\{}'", max_size=6)}, optional={"days": st.integers(-5, 10)}
)


def _streamed(chunks: list[str], truncated: bool) -> tuple[str, list[tuple[str, str]]]:
    parser = StreamingToolCallParser(TOOLS)
    deltas = [d for c in chunks for d in parser.feed(c)] + parser.finish(truncated=truncated)
    assert all(set(d) <= {"content", "tool_calls"} for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls = [
        (c["function"]["name"], c["function"]["arguments"])
        for d in deltas
        for c in d.get("tool_calls", [])
    ]
    return content, calls


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def _in_form(form: str, name: str, args: dict[str, Any], pretty: bool) -> str:
    body = json.dumps({"name": name, "arguments": args}, indent=2 if pretty else None)
    if form == "tagged":
        return format_call(name, json.dumps(args))
    if form == "fenced":
        return f"```json\n{body}\n```"
    if form == "name_tags":
        arguments = json.dumps(args, indent=2 if pretty else None)
        return f"<name>{name}</name>\n<arguments>{arguments}</arguments>"
    return body


@FAST
@given(text=MODEL_TEXT, cuts=st.lists(st.integers(0, 200), max_size=6), truncated=st.booleans())
def test_streaming_equals_batch_with_offered_tools(
    text: str, cuts: list[int], truncated: bool
) -> None:
    content, calls = parse_tool_calls(text, truncated=truncated, tools=TOOLS)
    expected = (content or "", [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
    assert _streamed(_split(text, cuts), truncated) == expected
    if not calls and not truncated:
        assert content == text  # text without a call comes back exactly
    for name, arguments in expected[1]:
        assert name in OFFERED or "<tool_call>" in text
        assert isinstance(json.loads(arguments), dict)


@FAST
@given(
    form=st.sampled_from(["tagged", "fenced", "bare", "name_tags"]),
    pretty=st.booleans(),
    args=ARGS,
    lead=LINE,
    trail=LINE,
    cuts=st.lists(st.integers(0, 300), max_size=4),
)
def test_a_call_in_each_form_is_found_between_lines(
    form: str, pretty: bool, args: dict[str, Any], lead: str, trail: str, cuts: list[int]
) -> None:
    text = f"{lead}\n{_in_form(form, 'get_weather', args, pretty)}\n{trail}"
    content, calls = parse_tool_calls(text, tools=TOOLS)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == args
    pieces = [p for p in (lead.rstrip(), trail.lstrip()) if p]  # whitespace by a call goes
    assert content == ("\n".join(pieces) or None)
    assert _streamed(_split(text, cuts), False) == (
        content or "",
        [("get_weather", calls[0]["function"]["arguments"])],
    )


@FAST
@given(
    form=st.sampled_from(["fenced", "bare", "name_tags"]),
    name=st.sampled_from(["get_wether", "weather", "getWeather", ""]),
    args=ARGS,
    pretty=st.booleans(),
)
def test_json_naming_no_offered_function_stays_content(
    form: str, name: str, args: dict[str, Any], pretty: bool
) -> None:
    text = "Here:\n" + _in_form(form, name, args, pretty) + "\nok"
    assert parse_tool_calls(text, tools=TOOLS) == (text, [])
    missing = "Here:\n" + _in_form(form, "get_weather", {"days": 2}, pretty)  # no "city"
    assert parse_tool_calls(missing, tools=TOOLS) == (missing, [])
    assert parse_tool_calls(_in_form(form, "get_weather", args, pretty))[1] == []  # no tools


@FAST
@given(
    form=st.sampled_from(["fenced", "bare", "name_tags"]),
    pretty=st.booleans(),
    args=ARGS,
    lead=LINE,
    data=st.data(),
)
def test_a_json_call_cut_short_never_leaks(
    form: str, pretty: bool, args: dict[str, Any], lead: str, data: st.DataObject
) -> None:
    whole = f"{lead}\n{_in_form(form, 'get_weather', args, pretty)}"
    text = whole[: data.draw(st.integers(len(lead) + 2, len(whole)))]
    content, calls = parse_tool_calls(text, truncated=True, tools=TOOLS)
    assert len(calls) <= 1
    if calls:  # cut after the call's JSON: the call, and no markup in the content
        assert content == (lead.rstrip() or None)
        assert json.loads(calls[0]["function"]["arguments"]) == args
    else:  # cut inside it: the unfinished call is dropped, the text before it kept
        assert content == lead + "\n"
    assert _streamed(list(text), truncated=True) == (
        content or "",
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
    )


# ---------------------------------------------------------------- recorded Qwen outputs


def _tool(name: str, *required: str) -> dict[str, Any]:
    properties = {key: {"type": "string"} for key in required}
    return {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": properties, "required": list(required)},
        },
    }


# The functions `bench/tool_forms.py` offered (each reply below was offered some of them).
RECORDED_TOOLS = parse_tools(
    [
        _tool("get_weather", "city"),
        _tool("get_time", "timezone"),
        _tool("search_web", "query"),
        _tool("convert_currency", "amount", "source", "target"),
    ]
)
WEATHER_OSLO = ("get_weather", {"city": "Oslo"})
# Replies of qwen2.5-coder-0.5b (bench/tool_forms.py, seed 0, temperature 0.8), verbatim:
# (text, truncated, expected content, expected calls as (name, arguments)).
RECORDED: list[tuple[str, bool, str | None, list[tuple[str, dict[str, Any]]]]] = [
    # a fenced, pretty-printed call: the most common form
    (
        '```json\n{\n    "name": "get_weather",\n    "arguments": {\n        "city": "Oslo"\n    }\n}\n```',
        False,
        None,
        [WEATHER_OSLO],
    ),
    # two calls in one fence
    (
        '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n{"name": "get_time", "arguments": {"timezone": "Europe/Oslo"}}\n```',
        False,
        None,
        [WEATHER_OSLO, ("get_time", {"timezone": "Europe/Oslo"})],
    ),
    # a bare call (a space before the last brace)
    (
        '{"name": "search_web", "arguments": {"query": "<your_query_here>"} }',
        False,
        None,
        [("search_web", {"query": "<your_query_here>"})],
    ),
    # two bare calls separated by a comma
    (
        '{"name": "get_weather", "arguments": {"city": "Rome", "timezone": "Europe/Oslo"}},\n{"name": "get_time", "arguments": {"timezone": "Europe/Oslo"}}',
        False,
        None,
        [
            ("get_weather", {"city": "Rome", "timezone": "Europe/Oslo"}),
            ("get_time", {"timezone": "Europe/Oslo"}),
        ],
    ),
    # a bare call between prose, in a reply cut by max_tokens after it
    (
        'Here\'s the JSON response for the `get_weather` function call:\n\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n\nPlease note that this response is a JSON object with the function name and arguments. The actual JSON response will depend on the response from the server, as the server might be able to return different types of',
        True,
        "Here's the JSON response for the `get_weather` function call:\nPlease note that this response is a JSON object with the function name and arguments. The actual JSON response will depend on the response from the server, as the server might be able to return different types of",
        [("get_weather", {"city": "Tokyo"})],
    ),
    # the model ended its reply one closing brace short: it meant the call
    (
        '{"name": "get_weather", "arguments": {"city": "London"}',
        False,
        None,
        [("get_weather", {"city": "London"})],
    ),
    # ... but cut short there by max_tokens, the arguments may be unfinished: dropped
    ('{"name": "get_weather", "arguments": {"city": "London"}', True, "", []),
    # a function that was not offered (search_web was): content
    (
        '```json\n{\n    "name": "send_email",\n    "arguments": {\n        "to": "boss@example.com",\n        "subject": "Late to work!",\n        "body": "I\'m sorry to hear that you\'re late. Please make sure to arrive early tomorrow."\n    }\n}\n```',
        False,
        "same",
        [],
    ),
    # the prompt's tool listing written back, cut short: content, nothing dropped
    (
        '<tools>\n{"type": "function", "function": {"name": "get_time", "description": "Current local time in a timezone.", "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "description": "IANA name, e.g. Europe/Oslo"}, "required": ["timezone',
        True,
        "same",
        [],
    ),
    # the name-tag form (and in `liveloop demo`, the weather users' first questions)
    (
        '<name>get_weather</name>\n<arguments>{"city": "London"}</arguments>',
        False,
        None,
        [("get_weather", {"city": "London"})],
    ),
    # ... naming a function that was not offered, or cut short inside its arguments
    ('<name>send_email</name>\n<arguments>{"to": "x"}</arguments>', False, "same", []),
    ('<name>get_weather</name>\n<arguments>{"city": "Lon', True, "", []),
    # plain prose: content
    ("The current temperature in Tokyo is 32 degrees Celsius.", False, "same", []),
]


@pytest.mark.parametrize(("text", "truncated", "content", "calls"), RECORDED)
def test_recorded_qwen_replies(
    text: str, truncated: bool, content: str | None, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    parsed_content, parsed = parse_tool_calls(text, truncated=truncated, tools=RECORDED_TOOLS)
    assert parsed_content == (text if content == "same" else content)
    found = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed]
    assert found == calls
    expected = (
        parsed_content or "",
        [(c["function"]["name"], c["function"]["arguments"]) for c in parsed],
    )
    for cut in range(len(text) + 1):  # streamed in two pieces, cut at every point
        parser = StreamingToolCallParser(RECORDED_TOOLS)
        deltas = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish(truncated)
        streamed = (
            "".join(d.get("content", "") for d in deltas),
            [(c["function"]["name"], c["function"]["arguments"]) for d in deltas for c in d.get("tool_calls", [])],
        )  # fmt: skip
        assert streamed == expected, cut

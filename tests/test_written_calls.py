"""Which reply texts are tool calls written as text (what the judge and the report count as
a failed re-call rather than an answer), on forms the Coder models wrote in demo runs."""

from __future__ import annotations

import pytest

from liveloop.written_calls import written_call


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ('{"name": "weather_in_paris", "arguments": {"city": "Paris"}}', "weather_in_paris"),
        ('```json\n{"name": "get_weather", "parameters": {}}\n```', "get_weather"),
        ('Let me check.\n{ "name" : "get_weather", "arguments": "{}" }', "get_weather"),
        ("{'name': 'get_weather', 'arguments': {'city': 'Paris'}}\n", "get_weather"),
        ('name: get_weather\narguments: {"city": "Oslo"}', "get_weather"),
        ('get_weather({"city": "Oslo"})', "get_weather"),
        ('```python\nget_weather({"city": "Oslo"})\n```', "get_weather"),
        ('<tool_call>\n{"name": "get_weather"', "get_weather"),
        ("<tool_call>", ""),
    ],
)
def test_calls_written_as_text(text: str, name: str) -> None:
    assert written_call(text) == name


@pytest.mark.parametrize(
    "text",
    [
        "It is snowing in Oslo, -3 C.",
        '{"city": "Oslo", "weather": "snow"}',  # JSON, but no function named
        'The name: "Oslo" is Norwegian.',
        'Call get_weather({"city": "Oslo"}) to find out.',  # prose about a call
        "",
    ],
)
def test_answers_and_other_text_are_not_calls(text: str) -> None:
    assert written_call(text) is None

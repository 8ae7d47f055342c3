"""Reading one tool call (or a list of them) out of a JSON text.

A call is a JSON object with a string `name` and an object `arguments` (Llama-style
`parameters` is read the same way; arguments given as a JSON string holding an object are
accepted too). Inside `<tool_call>` tags any name is a call, and missing arguments mean `{}`.
JSON outside the tags (a fenced block or a bare object, as instruct models often write when
a chat template offers tools) is a call only when it names an offered function and its
arguments are an object holding every property that function's schema requires: text that
merely looks like JSON stays content.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from liveloop.server.tools.spec import ToolSpec

JSON_WHITESPACE = " \t\n\r"
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class ParsedCall:
    """A call's function name and its arguments as JSON text (as the model wrote it)."""

    name: str
    arguments: str


def skip_ws(text: str, i: int) -> int:
    """The index of the first non-whitespace character at or after `i`."""
    while i < len(text) and text[i] in JSON_WHITESPACE:
        i += 1
    return i


def _scan(text: str, start: int) -> tuple[int | None, list[str], bool]:
    """Brackets from `start`: (index past the matching close or None, the closers still
    owed, whether the text ends inside a string). Matched outside strings only."""
    owed: list[str] = []
    in_string = False
    i = start
    while i < len(text):
        ch = text[i]
        if in_string:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            owed.append("}" if ch == "{" else "]")
        elif ch in "}]":
            owed.pop()
            if not owed:
                return i + 1, [], False
        i += 1
    return None, owed, in_string


def json_value_end(text: str, start: int) -> int | None:
    """Index just past the object or array opening at `start`, None while it is still open.

    Whether the text is valid JSON is left to the parser, so a balanced but invalid text
    still has an end.
    """
    return _scan(text, start)[0]


def closed_json(text: str) -> str | None:
    """An unfinished object or array with the closing brackets it lacks appended.

    A model that ends its reply with `{"name": "f", "arguments": {"x": 1}` meant the call;
    None when the text ends inside a string or the value is already closed.
    """
    end, owed, in_string = _scan(text, 0)
    if end is not None or in_string or not owed:
        return None
    return text.rstrip(JSON_WHITESPACE) + "".join(reversed(owed))


def _raw_members(text: str) -> dict[str, tuple[Any, str]] | None:
    """Members of a JSON object text as key -> (value, raw value text); None if not an object."""
    decoder = json.JSONDecoder()
    try:
        value, end = decoder.raw_decode(text)
    except ValueError:
        return None
    if end != len(text) or not isinstance(value, dict):
        return None
    members: dict[str, tuple[Any, str]] = {}
    i = skip_ws(text, 1)
    while text[i] != "}":  # the text parsed as an object, so this walk cannot go wrong
        key, i = decoder.raw_decode(text, i)
        i = skip_ws(text, skip_ws(text, i) + 1)  # past ':'
        start = i
        member, i = decoder.raw_decode(text, i)
        members[key] = (member, text[start:i])
        i = skip_ws(text, i)
        if text[i] == ",":
            i = skip_ws(text, i + 1)
    return members


def _raw_elements(text: str) -> list[str] | None:
    """The raw text of each element of a JSON array text; None if not an array."""
    decoder = json.JSONDecoder()
    try:
        value, end = decoder.raw_decode(text)
    except ValueError:
        return None
    if end != len(text) or not isinstance(value, list):
        return None
    elements: list[str] = []
    i = skip_ws(text, 1)
    while text[i] != "]":
        start = i
        _, i = decoder.raw_decode(text, i)
        elements.append(text[start:i])
        i = skip_ws(text, i)
        if text[i] == ",":
            i = skip_ws(text, i + 1)
    return elements


def _arguments(members: dict[str, tuple[Any, str]]) -> tuple[dict[str, Any], str] | None:
    """The arguments object and its JSON text; ({}, "{}") when absent; None when not an object."""
    key = next((k for k in ARGUMENT_KEYS if k in members), None)
    if key is None:
        return {}, "{}"
    value, raw = members[key]
    if isinstance(value, str):  # arguments given as a JSON string holding the object
        inner = value.strip(JSON_WHITESPACE)
        try:
            decoded = json.loads(inner)
        except ValueError:
            return None
        return (decoded, inner) if isinstance(decoded, dict) else None
    return (value, raw) if isinstance(value, dict) else None


def parse_call_body(body: str) -> ParsedCall | None:
    """The call held by the text between `<tool_call>` tags, or None when it is not one."""
    members = _raw_members(body.strip(JSON_WHITESPACE))
    if members is None or "name" not in members:
        return None
    name = members["name"][0]
    if not isinstance(name, str) or not name:
        return None
    arguments = _arguments(members)
    return None if arguments is None else ParsedCall(name, arguments[1])


def _offered_call(text: str, offered: Mapping[str, ToolSpec]) -> ParsedCall | None:
    members = _raw_members(text)
    if members is None or "name" not in members:
        return None
    name = members["name"][0]
    tool = offered.get(name) if isinstance(name, str) else None
    arguments = _arguments(members)
    if tool is None or arguments is None:
        return None
    required = tool.parameters.get("required")
    if isinstance(required, list) and any(key not in arguments[0] for key in required):
        return None
    return ParsedCall(tool.name, arguments[1])


def parse_offered_calls(text: str, offered: Mapping[str, ToolSpec]) -> list[ParsedCall] | None:
    """The calls in a JSON object or array text when every one is a valid call of an offered
    function (see the module docstring); None otherwise."""
    text = text.strip(JSON_WHITESPACE)
    if not offered or not text:
        return None
    if text[0] == "{":
        call = _offered_call(text, offered)
        return None if call is None else [call]
    elements = _raw_elements(text)
    if not elements:
        return None
    calls = [_offered_call(element, offered) for element in elements]
    return [call for call in calls if call is not None] if all(calls) else None


def could_begin_call(text: str, offered: Mapping[str, ToolSpec]) -> bool:
    """Whether JSON text cut short may be the start of a call of an offered function.

    Judged on the text without whitespace: it must be a prefix of `{"name":"<function>"` (or
    of `[{"name":...`), or begin with it, for some offered function.
    """
    compact = "".join(text.split())
    if compact.startswith("["):
        compact = compact[1:]
    for name in offered:
        head = '{"name":' + json.dumps(name)
        if head.startswith(compact) or compact.startswith(head):
            return True
    return False

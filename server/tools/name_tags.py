"""The name-tag form of a tool call: `<name>get_weather</name>` then `<arguments>{...}</arguments>`.

Qwen2.5-Coder-0.5B writes its call this way now and then when its chat template offers tools
(the demo's version 0 did for 2 of its first weather questions; `bench/tool_forms.py` saw it
once in 250 replies). As with fenced and bare JSON, it is a call only when the request offered
tools, the tags open a line, the name is an offered function and the arguments are a JSON
object holding every property that function requires; anything else is content as written.
A reply the model ended (not one cut short) may lack the closing `</arguments>`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Literal

from liveloop.server.tools.call_json import ParsedCall, parse_offered_calls
from liveloop.server.tools.spec import ToolSpec

NAME_OPEN = "<name>"
ARGUMENTS_OPEN = "<arguments>"
ARGUMENTS_CLOSE = "</arguments>"
NAME = r"[A-Za-z0-9_-]{1,64}"
HEAD = re.compile(rf"<name>[ \t]*({NAME})[ \t]*</name>\s*<arguments>")


def _any_prefix(literal: str) -> str:
    """A pattern matching any prefix of `literal`, the empty one included."""
    pattern = ""
    for ch in reversed(literal):
        pattern = f"(?:{re.escape(ch)}{pattern})?"
    return pattern


# A head still being written: the text so far could become `HEAD`.
PARTIAL_HEAD = re.compile(
    rf"<name>[ \t]*(?:{NAME})?[ \t]*"
    rf"(?:</name>\s*{_any_prefix(ARGUMENTS_OPEN)}|{_any_prefix('</name>')})\Z"
)

NameTagStep = tuple[Literal["text", "calls", "drop"], int, list[ParsedCall]]


def name_tag_step(
    text: str, offered: Mapping[str, ToolSpec], final: bool, truncated: bool
) -> NameTagStep | None:
    """What `text` (which starts with `<name>` at a line start) is: a call and its length,
    content (the opening tag, read on as text), an unfinished call cut short (dropped), or
    None until more text arrives."""
    head = HEAD.match(text)
    if head is None:
        if PARTIAL_HEAD.match(text):
            if not final:
                return None
            if truncated:
                return ("drop", len(text), [])
        return ("text", len(NAME_OPEN), [])
    close = text.find(ARGUMENTS_CLOSE, head.end())
    if close < 0 and not final:
        return None
    if close < 0 and truncated:  # cut short inside the arguments: markup when it may be a call
        rest = text[head.end() :].lstrip()
        if head.group(1) in offered and (not rest or rest.startswith("{")):
            return ("drop", len(text), [])
        return ("text", len(NAME_OPEN), [])
    body = text[head.end() : len(text) if close < 0 else close].strip()
    calls = _tagged_call(head.group(1), body, offered)
    if calls is None:
        return ("text", len(NAME_OPEN), [])
    return ("calls", len(text) if close < 0 else close + len(ARGUMENTS_CLOSE), calls)


def _tagged_call(
    name: str, arguments: str, offered: Mapping[str, ToolSpec]
) -> list[ParsedCall] | None:
    """The call when `arguments` is one JSON object and the call is valid for `offered`."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return parse_offered_calls(f'{{"name": {json.dumps(name)}, "arguments": {arguments}}}', offered)

"""Tool calls written as text: replies that try to call a function but were not served as a call.

The server turns a reply into `tool_calls` only when it names an offered function with valid
arguments; anything else stays content. A model that has just been shown a tool's result
and writes `{"name": "weather_in_paris", "arguments": {...}}` (or that as a Python dict in
single quotes), `name: get_weather` and `arguments: {...}` on two lines, or
`get_weather({"city": "Oslo"})`, has not answered the user: it tried to call a tool again
and got the form wrong. The rule judge scores such a reply as a repeated call and the
demo's report does not count it as an answer.
"""

from __future__ import annotations

import re

# A JSON object (or a Python dict, in single quotes) that opens with a name and then its
# arguments (or Llama-style parameters).
JSON_CALL = re.compile(
    r"""\{\s*(["'])name\1\s*:\s*["']([^"'\n]{1,80})["']\s*,\s*["'](?:arguments|parameters)["']\s*:"""
)
# `name: f` and `arguments: ...` on the next line (a YAML-like call).
LINES_CALL = re.compile(r"^\s*name:\s*([\w.-]{1,80})\s*\n\s*(?:arguments|parameters):", re.M)
# The whole reply is one function-call expression with an object argument: `f({...})`.
EXPRESSION_CALL = re.compile(
    r"\s*(?:```\w*\s*)?([A-Za-z_][\w.]{0,79})\(\s*\{.*\}\s*\)\s*(?:```)?\s*", re.S
)
TAGGED_CALL = re.compile(r"<tool_call>\s*(?:\{\s*\"name\"\s*:\s*\"([^\"\n]{1,80})\")?")


def written_call(text: str) -> str | None:
    """The function name a reply's text tries to call ('' when the name is unreadable), or
    None when the text is not a call."""
    match = JSON_CALL.search(text)
    if match:
        return match.group(2)
    for pattern in (TAGGED_CALL, LINES_CALL):
        match = pattern.search(text)
        if match:
            return match.group(1) or ""
    match = EXPRESSION_CALL.fullmatch(text)
    return match.group(1) if match else None

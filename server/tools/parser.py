"""Reading tool calls back out of model text, all at once or delta by delta while streaming.

A call is a `<tool_call>...</tool_call>` block holding a JSON object with a string `name` and
an object `arguments` (a closing tag may be missing at the very end of the text). A block that
does not hold such an object is ordinary content. Content is the text outside the calls, with
the whitespace that touches a call removed and pieces separated by calls joined by a newline;
text without any call is returned exactly. The streaming parser reaches the same result for any
split of the text into deltas: it holds back what may still turn into a call (a partial opening
tag, whitespace in front of one, an open block) until that is decided.

Text cut short (by `max_tokens`, or aborted) may end inside a call that was never finished:
an unclosed block that does not hold a valid call, or the first characters of an opening tag
(`<tool`). That unfinished tail is markup, not content, and both parsers drop it when told
the text was truncated; a complete call before it is still returned.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from liveloop.server.tools.format import CLOSE_TAG, OPEN_TAG

JSON_WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class ParsedCall:
    """A call's function name and its arguments as JSON text (as the model wrote it)."""

    name: str
    arguments: str


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id."""
    return "call_" + uuid.uuid4().hex[:24]


def call_dict(call: ParsedCall, call_id: str) -> dict[str, Any]:
    """A call in the shape of OpenAI's `message.tool_calls` entries."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in JSON_WHITESPACE:
        i += 1
    return i


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
    i = _skip_ws(text, 1)
    while text[i] != "}":  # the text parsed as an object, so this walk cannot go wrong
        key, i = decoder.raw_decode(text, i)
        i = _skip_ws(text, _skip_ws(text, i) + 1)  # past ':'
        start = i
        member, i = decoder.raw_decode(text, i)
        members[key] = (member, text[start:i])
        i = _skip_ws(text, i)
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
    return members


def parse_call_body(body: str) -> ParsedCall | None:
    """The call held by the text between the tags, or None when it is not a valid call."""
    members = _raw_members(body.strip(JSON_WHITESPACE))
    if members is None or "name" not in members:
        return None
    name = members["name"][0]
    if not isinstance(name, str) or not name:
        return None
    if "arguments" not in members:
        return ParsedCall(name, "{}")
    arguments, raw = members["arguments"]
    if isinstance(arguments, str):  # arguments given as a JSON string holding the object
        inner = _raw_members(arguments.strip(JSON_WHITESPACE))
        return ParsedCall(name, arguments.strip(JSON_WHITESPACE)) if inner is not None else None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(name, raw)


def split_tool_calls(text: str, truncated: bool = False) -> list[str | ParsedCall]:
    """The text as alternating content pieces (merged, untrimmed) and valid calls.

    With `truncated`, an unfinished call at the end (see the module docstring) is dropped.
    """
    parts: list[str | ParsedCall] = []
    pending = ""
    pos = 0
    while True:
        start = text.find(OPEN_TAG, pos)
        if start < 0:
            rest = text[pos:]
            pending += rest[: len(rest) - _partial_tag_length(rest)] if truncated else rest
            break
        close = text.find(CLOSE_TAG, start + len(OPEN_TAG))
        end = len(text) if close < 0 else close + len(CLOSE_TAG)
        call = parse_call_body(text[start + len(OPEN_TAG) : len(text) if close < 0 else close])
        if call is None and close < 0 and truncated:
            pending += text[pos:start]
        elif call is None:
            pending += text[pos:end]
        else:
            parts += [pending + text[pos:start], call]
            pending = ""
        pos = end
    parts.append(pending)
    return parts


def parse_tool_calls(text: str, truncated: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
    """Content and OpenAI `tool_calls` entries found in a model's output.

    Content is None when the text holds calls and nothing else but whitespace. `truncated`:
    the text was cut short, so an unfinished call at its end is dropped, not content.
    """
    parts = split_tool_calls(text, truncated)
    calls = [part for part in parts if isinstance(part, ParsedCall)]
    if not calls:
        return "".join(p for p in parts if isinstance(p, str)), []
    pieces: list[str] = []
    for i, part in enumerate(parts):
        if isinstance(part, ParsedCall):
            continue
        if i > 0:
            part = part.lstrip()
        if i < len(parts) - 1:
            part = part.rstrip()
        if part:
            pieces.append(part)
    content = "\n".join(pieces) or None
    return content, [call_dict(call, new_call_id()) for call in calls]


class StreamingToolCallParser:
    """Turns streamed model text into OpenAI chat-completion-chunk deltas.

    Plain text comes out as `{"content": ...}` as soon as it cannot be part of a call; each
    call comes out whole, as one `{"tool_calls": [...]}` delta, once its closing tag arrives
    (or at `finish()` when the text ends inside a valid block). Fed the same text in any
    pieces, it yields the content and calls that `parse_tool_calls` finds.
    """

    def __init__(self) -> None:
        self._pending = ""  # undecided text: a partial opening tag, or an open block's body
        self._in_block = False
        self._held_ws = ""  # trailing whitespace of the current piece, dropped if a call follows
        self._piece_started = False
        self._after_call = False
        self._any_content = False
        self._calls = 0

    @property
    def num_calls(self) -> int:
        """How many tool calls have been emitted so far."""
        return self._calls

    def feed(self, text_delta: str) -> list[dict[str, Any]]:
        """Deltas made certain by this piece of text (possibly none)."""
        self._pending += text_delta
        out: list[dict[str, Any]] = []
        while True:
            if self._in_block:
                close = self._pending.find(CLOSE_TAG)
                if close < 0:
                    break
                body = self._pending[:close]
                self._pending = self._pending[close + len(CLOSE_TAG) :]
                self._in_block = False
                self._end_block(body, CLOSE_TAG, out)
                continue
            start = self._pending.find(OPEN_TAG)
            if start < 0:
                keep = _partial_tag_length(self._pending)
                self._push_text(self._pending[: len(self._pending) - keep], out)
                self._pending = self._pending[len(self._pending) - keep :]
                break
            self._push_text(self._pending[:start], out)
            self._pending = self._pending[start + len(OPEN_TAG) :]
            self._in_block = True
        return _merge_content(out)

    def finish(self, truncated: bool = False) -> list[dict[str, Any]]:
        """Deltas for whatever was still held back when the text ends.

        `truncated`: the text was cut short; an unfinished call at its end is dropped.
        """
        out: list[dict[str, Any]] = []
        if self._in_block:
            self._in_block = False
            if not truncated or parse_call_body(self._pending) is not None:
                self._end_block(self._pending, "", out)
        elif not truncated:
            self._push_text(self._pending, out)
        else:
            keep = len(self._pending) - _partial_tag_length(self._pending)
            self._push_text(self._pending[:keep], out)
        self._pending = ""
        if self._held_ws:
            out.append({"content": self._held_ws})
            self._held_ws = ""
        return _merge_content(out)

    def _end_block(self, body: str, close: str, out: list[dict[str, Any]]) -> None:
        call = parse_call_body(body)
        if call is None:
            self._push_text(OPEN_TAG + body + close, out)
            return
        entry = {"index": self._calls, **call_dict(call, new_call_id())}
        out.append({"tool_calls": [entry]})
        self._calls += 1
        self._held_ws = ""
        self._piece_started = False
        self._after_call = True

    def _push_text(self, text: str, out: list[dict[str, Any]]) -> None:
        """Emit text known to be content, holding back its trailing whitespace."""
        text = self._held_ws + text
        if not self._piece_started and self._after_call:
            text = text.lstrip()
        body = text.rstrip()
        self._held_ws = text[len(body) :]
        if not body:
            return
        if not self._piece_started and self._any_content:
            body = "\n" + body
        out.append({"content": body})
        self._piece_started = True
        self._any_content = True


def _partial_tag_length(text: str) -> int:
    """Length of the longest end of `text` that could begin an opening tag."""
    for size in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if OPEN_TAG.startswith(text[-size:]):
            return size
    return 0


def _merge_content(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Join neighbouring content deltas so each feed yields as few chunks as possible."""
    merged: list[dict[str, Any]] = []
    for delta in deltas:
        if "content" in delta and merged and "content" in merged[-1]:
            merged[-1] = {"content": merged[-1]["content"] + delta["content"]}
        else:
            merged.append(delta)
    return merged

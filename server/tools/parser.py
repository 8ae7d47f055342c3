"""Reading tool calls back out of model text, all at once or delta by delta while streaming.

A call is a `<tool_call>...</tool_call>` block holding a JSON object with a string `name` and
an object `arguments` (a closing tag may be missing at the very end of the text). A block that
does not hold such an object is ordinary content.

When the request offered tools, three more forms count, because instruct models write them
although their chat template asks for tags (Qwen2.5-Coder-0.5B, offered tools, wrote no
tags at all: about half its calls fenced, half bare; `bench/tool_forms.py`):
- a fenced block (a line opening with three backticks and `json` or no language) holding
  one or more call objects (separated by whitespace or commas), or an array of them; the
  closing fence may be missing at the end;
- a bare JSON object (or array of objects) that starts a line; a comma right after it
  (separating it from the next call) belongs to it;
- `<name>function</name>` and `<arguments>{...}</arguments>` opening a line (`name_tags`).
Such JSON is a call only when it names an offered function with valid arguments (see
`call_json`); anything else stays content, exactly as written. A reply the model ended
(not one cut short) inside such JSON, lacking only closing brackets, is read with them
added: the model meant the call. Other fenced code blocks are content, fences and all.

Content is the text outside the calls, with the whitespace that touches a call removed and
pieces separated by calls joined by a newline; text without any call is returned exactly.
The streaming parser holds back what may still turn into a call (a partial opening tag or
fence, an open block, fence or JSON object that starts a line) until that is decided, and
reaches the same result for any split of the text into deltas: `parse_tool_calls` is the
streaming parser fed the whole text at once.

Text cut short (by `max_tokens`, or aborted) may end inside a call that was never finished:
an unclosed block that does not hold a valid call, the first characters of an opening tag
(`<tool`) or fence, or an unclosed fence or JSON object that begins like a call of an
offered function. That unfinished tail is markup, not content, and both parsers drop it
when told the text was truncated; a complete call before it is still returned.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from liveloop.server.tools.call_json import (
    ParsedCall,
    closed_json,
    could_begin_call,
    json_value_end,
    parse_call_body,
    parse_offered_calls,
    skip_ws,
)
from liveloop.server.tools.format import CLOSE_TAG, OPEN_TAG
from liveloop.server.tools.name_tags import NAME_OPEN, name_tag_step
from liveloop.server.tools.spec import ToolSpec

FENCE = "```"
FENCE_LANGUAGES = ("", "json")
FENCE_HEADER = re.compile(r"[ \t]*([A-Za-z_]*)[ \t]*")
JSON_OPENERS = "{["
LINE_SPACE = " \t"

# One decision about the start of the undecided text: its first `size` characters are
# content ("text"), a code fence that opens or closes a code block ("fence", content too),
# a call's markup ("calls"), or an unfinished call cut short ("drop").
Step = tuple[Literal["text", "fence", "calls", "drop"], int, list[ParsedCall]]


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


def parse_tool_calls(
    text: str, truncated: bool = False, tools: Sequence[ToolSpec] | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """Content and OpenAI `tool_calls` entries found in a model's output.

    Content is None when the text holds calls and nothing else but whitespace. `truncated`:
    the text was cut short, so an unfinished call at its end is dropped, not content.
    `tools`: the functions the request offered (enables the fenced and bare JSON forms).
    """
    parser = StreamingToolCallParser(tools)
    deltas = parser.feed(text) + parser.finish(truncated)
    content = "".join(d.get("content", "") for d in deltas)
    calls = [
        {key: value for key, value in call.items() if key != "index"}
        for delta in deltas
        for call in delta.get("tool_calls", [])
    ]
    return (content or None) if calls else content, calls


class StreamingToolCallParser:
    """Turns streamed model text into OpenAI chat-completion-chunk deltas.

    Plain text comes out as `{"content": ...}` as soon as it cannot be part of a call; each
    call comes out whole, as one `{"tool_calls": [...]}` delta, once its end arrives (or at
    `finish()` when the text ends inside a valid call). Fed the same text in any pieces, it
    yields the same content and calls.
    """

    def __init__(self, tools: Sequence[ToolSpec] | None = None) -> None:
        self._offered = {tool.name: tool for tool in tools or ()}
        self._pending = ""  # undecided text
        self._line_start = True  # the text before `_pending` ends where a line starts
        self._in_code = False  # `_pending` starts inside a fenced code block (not a call)
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
        self._drain(out, final=False, truncated=False)
        return _merge_content(out)

    def finish(self, truncated: bool = False) -> list[dict[str, Any]]:
        """Deltas for whatever was still held back when the text ends.

        `truncated`: the text was cut short; an unfinished call at its end is dropped.
        """
        out: list[dict[str, Any]] = []
        self._drain(out, final=True, truncated=truncated)
        if self._held_ws:
            out.append({"content": self._held_ws})
            self._held_ws = ""
        return _merge_content(out)

    def _drain(self, out: list[dict[str, Any]], final: bool, truncated: bool) -> None:
        while self._pending:
            step = self._step(final, truncated)
            if step is None:
                return
            kind, size, calls = step
            text, self._pending = self._pending[:size], self._pending[size:]
            if kind in ("text", "fence"):
                self._push_text(text, out)
                self._line_start = _ends_at_line_start(text, self._line_start)
                if kind == "fence":
                    self._in_code = not self._in_code
            elif kind == "calls":
                for call in calls:
                    self._push_call(call, out)
                self._line_start = True

    # Decisions -------------------------------------------------------------------------

    def _step(self, final: bool, truncated: bool) -> Step | None:
        """What the start of the undecided text is, or None until more text arrives."""
        text = self._pending
        start = self._next_candidate(text)
        if start is None:
            keep = self._undecided_tail(text)
            if keep == 0 or (final and not truncated):
                return ("text", len(text), [])
            if len(text) > keep:
                return ("text", len(text) - keep, [])
            return ("drop", keep, []) if final else None
        if start > 0:
            return ("text", start, [])
        if text.startswith(OPEN_TAG):
            return self._tag_step(text, final, truncated)
        if text.startswith(FENCE):
            return self._fence_step(text, final, truncated)
        if text.startswith(NAME_OPEN):
            return name_tag_step(text, self._offered, final, truncated)
        return self._json_step(text, final, truncated)

    def _next_candidate(self, text: str) -> int | None:
        """Where the first possible call starts: a tag, or a fence, JSON or `<name>` tag
        opening a line."""
        tag = text.find(OPEN_TAG)
        limit = len(text) if tag < 0 else tag
        if self._offered:
            line = 0 if self._line_start else _after_newline(text, 0)
            while line is not None and line < limit:
                first = line
                while first < len(text) and text[first] in LINE_SPACE:
                    first += 1
                if first < limit and (
                    text.startswith(FENCE, first)
                    or (text[first] in JSON_OPENERS and not self._in_code)
                    or (text.startswith(NAME_OPEN, first) and not self._in_code)
                ):
                    return first
                line = _after_newline(text, first)
        return None if tag < 0 else tag

    def _undecided_tail(self, text: str) -> int:
        """Length of the end of `text` that may still begin a tag, a fence or a name tag."""
        keep = _partial_tag_length(text)
        if not self._offered or self._in_code:  # a fence in a code block closes it: content
            return keep
        newline = text.rfind("\n")
        if newline < 0 and not self._line_start:
            return keep
        last_line = text[newline + 1 :].lstrip(LINE_SPACE)
        if last_line and (FENCE.startswith(last_line) or NAME_OPEN.startswith(last_line)):
            keep = max(keep, len(last_line))
        return keep

    def _tag_step(self, text: str, final: bool, truncated: bool) -> Step | None:
        close = text.find(CLOSE_TAG, len(OPEN_TAG))
        if close < 0 and not final:
            return None
        end = len(text) if close < 0 else close + len(CLOSE_TAG)
        call = parse_call_body(text[len(OPEN_TAG) : len(text) if close < 0 else close])
        if call is not None:
            return ("calls", end, [call])
        return ("drop" if close < 0 and truncated else "text", end, [])

    def _fence_step(self, text: str, final: bool, truncated: bool) -> Step | None:
        """A fence opening a line: a call if it holds only calls, else its backticks are text
        (that open a code block, or close the one open)."""
        if self._in_code:
            return ("fence", len(FENCE), [])
        newline = text.find("\n")
        header = FENCE_HEADER.fullmatch(text[len(FENCE) : len(text) if newline < 0 else newline])
        language = header.group(1).lower() if header else None
        if language is None or not any(
            lang == language or (newline < 0 and lang.startswith(language))
            for lang in FENCE_LANGUAGES
        ):
            return ("fence", len(FENCE), [])
        if newline < 0:
            if not final:
                return None
            return ("drop", len(text), []) if truncated else ("fence", len(FENCE), [])
        calls: list[ParsedCall] = []
        i = newline + 1
        while True:
            i = skip_ws(text, i)
            if text.startswith(FENCE, i) and calls:
                return ("calls", i + len(FENCE), calls)
            rest = text[i:]
            if not rest or (calls and FENCE.startswith(rest)):
                if not final:
                    return None
                if calls:  # the closing fence is missing at the very end
                    return ("calls", len(text), calls)
                return ("drop", len(text), []) if truncated else ("fence", len(FENCE), [])
            if rest[0] not in JSON_OPENERS:
                return ("fence", len(FENCE), [])
            end = json_value_end(text, i)
            if end is None:
                if not final:
                    return None
                if truncated and could_begin_call(rest, self._offered):  # the last call cut
                    return ("calls", len(text), calls) if calls else ("drop", len(text), [])
                found = None if truncated else self._unclosed_calls(rest.rstrip().rstrip("`"))
                if found is not None:
                    return ("calls", len(text), calls + found)
                return ("fence", len(FENCE), [])
            found = parse_offered_calls(text[i:end], self._offered)
            if found is None:
                return ("fence", len(FENCE), [])
            calls += found
            i = skip_ws(text, end)
            if text.startswith(",", i):  # calls separated by commas
                i += 1

    def _json_step(self, text: str, final: bool, truncated: bool) -> Step | None:
        """A JSON object or array opening a line: a call if it is one, else text."""
        first = skip_ws(text, 1)
        if first < len(text) and text[first] not in ('"}' if text[0] == "{" else "{]"):
            return ("text", 1, [])
        end = json_value_end(text, 0)
        if end is None:
            if not final:
                return None
            if truncated and could_begin_call(text, self._offered):
                return ("drop", len(text), [])
            calls = None if truncated else self._unclosed_calls(text)
            return ("text", 1, []) if calls is None else ("calls", len(text), calls)
        calls = parse_offered_calls(text[:end], self._offered)
        if calls is None:
            return ("text", end, [])
        after = end
        while after < len(text) and text[after] in LINE_SPACE:
            after += 1
        if after == len(text) and not final:
            return None  # a comma may follow that separates this call from the next
        return ("calls", after + 1 if text.startswith(",", after) else end, calls)

    def _unclosed_calls(self, text: str) -> list[ParsedCall] | None:
        """Calls in JSON the model ended without its last closing brackets, if it holds any."""
        closed = closed_json(text)
        return None if closed is None else parse_offered_calls(closed, self._offered)

    # Output ----------------------------------------------------------------------------

    def _push_call(self, call: ParsedCall, out: list[dict[str, Any]]) -> None:
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


def _after_newline(text: str, start: int) -> int | None:
    """Index just past the first newline at or after `start`, None if there is none."""
    newline = text.find("\n", start)
    return None if newline < 0 else newline + 1


def _ends_at_line_start(text: str, before: bool) -> bool:
    """Whether a line starts after `text` (spaces and tabs aside), given whether one did before."""
    body = text.rstrip(LINE_SPACE)
    return before if not body else body.endswith("\n")


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

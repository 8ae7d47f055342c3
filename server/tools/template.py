"""Rendering OpenAI-style chat messages into a prompt with the model's own chat template.

The chat template decides how tools appear. A template that refers to `tools` gets them (and
assistant `tool_calls`, `role: tool` results) in the shape Hugging Face templates expect. A
template without tool support (SmolLM2's ChatML one renders every role as
`<|im_start|>{role}\\n{content}<|im_end|>\\n`) gets a system-prompt section describing the
tools, earlier calls written back in the `<tool_call>` format that constrained decoding
produces, and tool results wrapped in `<tool_response>` blocks under the `tool` role.
"""

from __future__ import annotations

import json
import re
from typing import Any

from liveloop.server.tools.format import (
    CALL_SEPARATOR,
    format_call,
    tool_result_text,
    tools_system_section,
)
from liveloop.server.tools.pieces import PieceEncoder
from liveloop.server.tools.spec import ToolRequestError, parse_tools

TOOLS_REFERENCE = re.compile(r"\btools\b")


def content_text(content: Any, where: str) -> str:
    """A message's content as text: a string, None, or a list of text parts (joined by newlines)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ToolRequestError(
            f"{where}.content must be a string or a list of text parts", "messages"
        )
    texts: list[str] = []
    for i, part in enumerate(content):
        if (
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ToolRequestError(
                f"{where}.content[{i}] is not a text part ({kind!r}); only text is supported",
                "messages",
            )
    return "\n".join(texts)


class ChatTemplate:
    """A tokenizer's chat template made to render OpenAI chat messages, tools included."""

    def __init__(self, tokenizer: Any, tool_result_reminder: str = "") -> None:
        source = tokenizer.chat_template
        if isinstance(source, dict):
            source = source.get("tool_use") or source.get("default") or next(iter(source.values()))
        if not isinstance(source, str) or not source:
            raise ValueError("the tokenizer has no chat template")
        self._tokenizer = tokenizer
        self._template: str = source
        self._pieces = PieceEncoder.for_tokenizer(tokenizer)
        self.supports_tools: bool = bool(TOOLS_REFERENCE.search(source))
        self.tool_result_reminder = tool_result_reminder

    def render_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text for these messages (raises ToolRequestError for malformed ones)."""
        specs = [spec.as_openai() for spec in parse_tools(tools)]
        messages = with_reminders(messages, self.tool_result_reminder)
        if self.supports_tools:
            converted = [self._native_message(m, i) for i, m in enumerate(messages)]
            tools_arg = specs or None
        else:
            names = _call_names(messages)
            converted = [self._plain_message(m, i, names) for i, m in enumerate(messages)]
            if specs:
                converted = _with_tools_section(converted, tools_system_section(specs))
            tools_arg = None
        try:
            text = self._tokenizer.apply_chat_template(
                converted,
                tools=tools_arg,
                chat_template=self._template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as exc:  # jinja raises TemplateError (and others) from template code
            raise ToolRequestError(
                f"the chat template cannot render these messages: {exc}", "messages"
            ) from None
        return str(text)

    def check_reminder(self) -> None:
        """Raise ValueError unless the template renders the tool-result reminder where it goes
        (some templates reject a system message after the first)."""
        if not self.tool_result_reminder:
            return
        call = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "Hello."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": "ok"},
        ]
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        expected = reminder_text(self.tool_result_reminder, ["f"])
        try:
            text = self.render_text(messages, tools)
        except ToolRequestError as exc:
            raise ValueError(f"the chat template cannot render the reminder: {exc}") from None
        if expected not in text:
            raise ValueError("the chat template leaves the reminder out of the prompt")

    def render_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of `render_text` (the template's own special tokens, none added)."""
        return self.encode(self.render_text(messages, tools, add_generation_prompt))

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text: special tokens in it are recognised, none added."""
        if self._pieces is not None:  # what the Rust tokenizer gives, mostly from a cache
            return self._pieces.encode(text)
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is not None:  # the Rust tokenizer itself: same ids, a fraction of the time
            return list(backend.encode(text, add_special_tokens=False).ids)
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def _plain_message(self, message: Any, i: int, names: dict[str, str]) -> dict[str, Any]:
        """A message for a template without tool support: everything folded into content."""
        role, content = _role_and_content(message, i)
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                format_call(name, arguments)
                for _, name, arguments in _tool_calls(message["tool_calls"], i)
            ]
            blocks = CALL_SEPARATOR.join(calls)
            content = f"{content}\n{blocks}" if content else blocks
        elif role == "tool":
            call_id = message.get("tool_call_id")
            call_id = call_id if isinstance(call_id, str) else None
            name = message.get("name") or (names.get(call_id) if call_id else None)
            content = tool_result_text(content, name, call_id)
        return {"role": role, "content": content}

    def _native_message(self, message: Any, i: int) -> dict[str, Any]:
        """A message for a template that renders tools itself (Hugging Face conventions)."""
        role, content = _role_and_content(message, i)
        out: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and message.get("tool_calls"):
            out["tool_calls"] = [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": _arguments_object(arguments)},
                }
                for call_id, name, arguments in _tool_calls(message["tool_calls"], i)
            ]
        for key in ("tool_call_id", "name"):
            if role == "tool" and isinstance(message.get(key), str):
                out[key] = message[key]
        return out


def reminder_text(reminder: str, names: list[str]) -> str:
    """The reminder with `{name}` filled in: the functions whose results it follows."""
    return reminder.replace("{name}", ", ".join(names) or "the tool")


def with_reminders(messages: list[dict[str, Any]], reminder: str) -> list[dict[str, Any]]:
    """The messages with a system message holding `reminder` after each run of tool results.

    Inserted after every run, not only a trailing one, so that the render of a conversation
    starts with the render of any earlier part of it (what prompt extension relies on)."""
    if not reminder:
        return messages
    names_by_id = _call_names(messages)
    out: list[dict[str, Any]] = []
    run: list[str] = []
    for i, message in enumerate(messages):
        out.append(message)
        if not _is_tool_result(message):
            continue
        call_id = message.get("tool_call_id")
        name = message.get("name") or names_by_id.get(call_id if isinstance(call_id, str) else "")
        if isinstance(name, str) and name not in run:
            run.append(name)
        if i + 1 == len(messages) or not _is_tool_result(messages[i + 1]):
            out.append({"role": "system", "content": reminder_text(reminder, run)})
            run = []
    return out


def last_reply_index(messages: list[dict[str, Any]]) -> int:
    """Index of the conversation's last assistant message, -1 when there is none."""
    return max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)


def _is_tool_result(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") == "tool"


def _role_and_content(message: Any, i: int) -> tuple[str, str]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ToolRequestError(f"messages[{i}] must be an object with a string 'role'", "messages")
    role = message["role"]
    return ("system" if role == "developer" else role), content_text(
        message.get("content"), f"messages[{i}]"
    )


def _tool_calls(calls: Any, i: int) -> list[tuple[str | None, str, Any]]:
    """(id, name, arguments) of an assistant message's tool calls, checked."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ToolRequestError(f"{where} must be a list", "messages")
    out: list[tuple[str | None, str, Any]] = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolRequestError(
                f"{where}[{j}] must have a function with a string name", "messages"
            )
        call_id = call.get("id") if isinstance(call.get("id"), str) else None
        out.append((call_id, function["name"], function.get("arguments", "{}")))
    return out


def _call_names(messages: list[dict[str, Any]]) -> dict[str, str]:
    """Tool call id -> function name, over all assistant messages (to label tool results)."""
    names: dict[str, str] = {}
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for call in calls if isinstance(calls, list) else []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(call.get("id"), str):
                names[call["id"]] = str(function.get("name"))
    return names


def _arguments_object(arguments: Any) -> Any:
    """Arguments as a dict where they are JSON object text (what tool-aware templates expect)."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


def _with_tools_section(messages: list[dict[str, Any]], section: str) -> list[dict[str, Any]]:
    """Messages with the tools section appended to the system message (or as a new one)."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        content = f"{first['content']}\n\n{section}" if first["content"] else section
        return [{**first, "content": content}, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]

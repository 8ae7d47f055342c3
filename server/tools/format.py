"""The tool-call text format used when a model's chat template has no tool support of its own.

Calls are written as `<tool_call>` + a JSON object `{"name": ..., "arguments": {...}}` +
`</tool_call>`, one per call, separated by a newline. The grammar (which forces this exact
shape), the parser (which reads it back) and the chat template (which renders earlier calls
in the history) all take it from here, so that a constrained completion re-renders into the
very same text in the next turn's prompt.
"""

from __future__ import annotations

import json
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
CALL_SEPARATOR = "\n"


def call_prefix(name: str) -> str:
    """Text of a call up to its arguments: what the grammar emits before the arguments object."""
    return f'{OPEN_TAG}\n{{"name": {json.dumps(name)}, "arguments": '


def call_suffix() -> str:
    """Text of a call after its arguments."""
    return "}\n" + CLOSE_TAG


def format_call(name: str, arguments: str) -> str:
    """One call in the canonical text form; `arguments` is JSON text, kept verbatim if valid."""
    return call_prefix(name) + arguments_text(arguments) + call_suffix()


def arguments_text(arguments: Any) -> str:
    """JSON text for a call's arguments given as a JSON string (kept verbatim) or a dict."""
    if isinstance(arguments, str):
        text = arguments.strip()
        try:
            json.loads(text)
        except ValueError:
            return json.dumps(arguments)
        return text
    return json.dumps(arguments, ensure_ascii=False)


def tools_system_section(tools: list[dict[str, Any]]) -> str:
    """System-prompt text that tells a template-less model which functions exist and how to call."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    example = format_call("function_name", '{"argument_name": "value"}')
    return (
        "# Available functions\n\n"
        "You can call the functions described below (JSON schemas, one per line):\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "To call a function, reply with a JSON object holding its name and arguments, wrapped "
        f"in {OPEN_TAG} tags; one block per call:\n{example}\n"
        "Each call's result comes back in a message from the tool."
    )


def tool_result_text(content: str, name: str | None, call_id: str | None) -> str:
    """How a `role: tool` message's content is shown to a template-less model."""
    attrs = ""
    if name:
        attrs += f" name={json.dumps(name)}"
    if call_id:
        attrs += f" id={json.dumps(call_id)}"
    return f"<tool_response{attrs}>\n{content}\n</tool_response>"

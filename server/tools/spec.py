"""Validation of the OpenAI request fields that shape tool calling and structured output.

The HTTP layer hands `tools`, `tool_choice` and `response_format` over as plain JSON; this
module checks them once and turns them into small typed values, so that the grammar and the
chat template never see malformed input and every problem becomes one 4xx naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolRequestError(ValueError):
    """A request's tools, tool_choice, response_format or schema cannot be honoured.

    `param` names the offending request field (OpenAI's error object carries it), so the
    server can answer with a 400 that points at the problem.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call: its name, description and JSON-schema parameters."""

    name: str
    description: str
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """The tool in OpenAI's request shape (what chat templates expect)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class OutputSpec:
    """What decoding must produce: forced tool calls, a JSON value, or anything (`free`)."""

    kind: Literal["free", "tool_calls", "json"]
    tools: list[ToolSpec] = field(default_factory=list)
    single_call: bool = False
    schema: dict[str, Any] | None = None  # kind "json": None means any JSON object

    def to_json(self) -> dict[str, Any]:
        """Plain JSON data (what crosses process and network boundaries)."""
        return {
            "kind": self.kind,
            "tools": [
                {"name": t.name, "description": t.description, "parameters": t.parameters}
                for t in self.tools
            ],
            "single_call": self.single_call,
            "schema": self.schema,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OutputSpec:
        """The spec `to_json` described."""
        return cls(
            kind=data["kind"],
            tools=[ToolSpec(**tool) for tool in data.get("tools", [])],
            single_call=bool(data.get("single_call", False)),
            schema=data.get("schema"),
        )


def parse_tools(tools: Any) -> list[ToolSpec]:
    """Check a request's `tools` list and return its functions (empty for None)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolRequestError("'tools' must be a list of function tools", "tools")
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        specs.append(_parse_tool(tool, f"tools[{i}]"))
    names = [spec.name for spec in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ToolRequestError(f"duplicate function names in 'tools': {duplicates}", "tools")
    return specs


def _parse_tool(tool: Any, where: str) -> ToolSpec:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ToolRequestError(f"{where} must be an object with type 'function'", "tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ToolRequestError(f"{where}.function must be an object", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ToolRequestError(
            f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-'", "tools"
        )
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise ToolRequestError(f"{where}.function.description must be a string", "tools")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = dict(EMPTY_PARAMETERS)
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ToolRequestError(
            f"{where}.function.parameters must be a JSON schema of type 'object'", "tools"
        )
    return ToolSpec(name=name, description=description, parameters=parameters)


def parse_output_spec(
    tools: list[ToolSpec],
    tool_choice: Any,
    response_format: Any,
    parallel_tool_calls: bool = True,
) -> OutputSpec:
    """Decide what decoding must produce; a forced tool call wins over a response format."""
    forced = _parse_tool_choice(tools, tool_choice)
    if forced is not None:
        return OutputSpec(
            kind="tool_calls", tools=forced[0], single_call=forced[1] or not parallel_tool_calls
        )
    return _parse_response_format(response_format)


def _parse_tool_choice(tools: list[ToolSpec], choice: Any) -> tuple[list[ToolSpec], bool] | None:
    """The tools a forced call may use and whether exactly one call is wanted; None if free."""
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required":
        if not tools:
            raise ToolRequestError(
                "tool_choice 'required' needs a non-empty 'tools' list", "tool_choice"
            )
        return tools, False
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ToolRequestError("tool_choice.function.name must be a string", "tool_choice")
        match = [tool for tool in tools if tool.name == name]
        if not match:
            known = [tool.name for tool in tools]
            raise ToolRequestError(
                f"tool_choice names function {name!r}, which is not in 'tools' {known}",
                "tool_choice",
            )
        return match, True
    raise ToolRequestError(
        "tool_choice must be 'auto', 'none', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def _parse_response_format(response_format: Any) -> OutputSpec:
    if response_format is None:
        return OutputSpec(kind="free")
    if not isinstance(response_format, dict):
        raise ToolRequestError("response_format must be an object", "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return OutputSpec(kind="free")
    if kind == "json_object":
        return OutputSpec(kind="json")
    if kind != "json_schema":
        raise ToolRequestError(
            "response_format.type must be 'text', 'json_object' or 'json_schema'",
            "response_format",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ToolRequestError("response_format.json_schema must be an object", "response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ToolRequestError(
            "response_format.json_schema.name must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-'",
            "response_format",
        )
    schema = spec.get("schema")
    if schema is None:
        return OutputSpec(kind="json")
    if not isinstance(schema, dict):
        raise ToolRequestError(
            "response_format.json_schema.schema must be a JSON schema object", "response_format"
        )
    return OutputSpec(kind="json", schema=schema)

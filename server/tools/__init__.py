"""Tool calling and structured output for the chat API.

Renders tools and tool-call history with the model's chat template, constrains decoding with
a grammar (xgrammar) when a tool call or a JSON schema is required, and parses tool calls out
of model text, in one go or while streaming. The HTTP server composes these pieces.
"""

from liveloop.server.tools.grammar import (
    ConstraintCompiler,
    GrammarConstraint,
    TokenConstraintFactory,
    build_constraint,
    compile_output,
)
from liveloop.server.tools.parser import StreamingToolCallParser, parse_tool_calls
from liveloop.server.tools.spec import ToolRequestError
from liveloop.server.tools.template import ChatTemplate

__all__ = [
    "ChatTemplate",
    "ConstraintCompiler",
    "GrammarConstraint",
    "StreamingToolCallParser",
    "TokenConstraintFactory",
    "ToolRequestError",
    "build_constraint",
    "compile_output",
    "parse_tool_calls",
]

"""Pydantic models of the chat API, following OpenAI's chat completions schema.

They validate requests (a bad field becomes a 400 naming it) and document responses in the
OpenAPI schema. Fields the official client may send but that do not change what this server
does (`user`, `store`, penalties, ...) are accepted and ignored, so unmodified agents work.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 16
MAX_STOP = 4


class _Lenient(BaseModel):
    """Unknown fields are ignored: the client echoes message objects with extra keys."""

    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    """A text part of a message's content."""

    type: Literal["text"]
    text: str


TextContent = str | list[Annotated[TextPart, Field(discriminator="type")]]


class FunctionCall(_Lenient):
    """The function a tool call invokes, with its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCall(_Lenient):
    """A tool call made by the assistant, echoed back by the client."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Lenient):
    """Instructions for the model."""

    role: Literal["system"]
    content: TextContent
    name: str | None = None


class DeveloperMessage(_Lenient):
    """OpenAI's newer name for system instructions; rendered as a system message."""

    role: Literal["developer"]
    content: TextContent
    name: str | None = None


class UserMessage(_Lenient):
    """A user turn (text only)."""

    role: Literal["user"]
    content: TextContent
    name: str | None = None


class AssistantMessage(_Lenient):
    """An earlier assistant turn: text and/or tool calls."""

    role: Literal["assistant"]
    content: TextContent | None = None
    tool_calls: list[ToolCall] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _has_something(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(_Lenient):
    """The result of a tool call, continuing the conversation."""

    role: Literal["tool"]
    content: TextContent
    tool_call_id: str = Field(min_length=1)


ChatMessage = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
    Field(discriminator="role"),
]


class FunctionDefinition(_Lenient):
    """A function the model may call; `parameters` is a JSON schema of its arguments."""

    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Lenient):
    """A tool offered to the model."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Lenient):
    """The function named by a forced tool choice."""

    name: str


class NamedToolChoice(_Lenient):
    """`tool_choice` forcing one function."""

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(_Lenient):
    """The schema of `response_format: json_schema`."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ResponseFormatText(_Lenient):
    """Plain text output (the default)."""

    type: Literal["text"]


class ResponseFormatJsonObject(_Lenient):
    """Any JSON object."""

    type: Literal["json_object"]


class ResponseFormatJsonSchema(_Lenient):
    """JSON matching a schema."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
    Field(discriminator="type"),
]


class StreamOptions(_Lenient):
    """Options of a streamed response."""

    include_usage: bool = False


class ChatCompletionRequest(_Lenient):
    """`POST /v1/chat/completions`."""

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    ignore_eos: bool = Field(False, description="Extension (as in vLLM): do not stop at EOS.")

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        stops = self.stop_list
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop: at most {MAX_STOP} stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop: stop sequences must not be empty")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def stop_list(self) -> list[str]:
        """`stop` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens`, else the legacy `max_tokens`."""
        return self.max_completion_tokens or self.max_tokens


# Responses ---------------------------------------------------------------------------


class TopLogprob(BaseModel):
    """One alternative token at a position."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """A sampled token with its log-prob and the most likely alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    """Log-probs of a choice's content tokens."""

    content: list[TokenLogprob] | None = None


class ResponseMessage(BaseModel):
    """The assistant message of a choice."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class Choice(BaseModel):
    """One sample of a completion."""

    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"]


class Usage(BaseModel):
    """Token counts of a request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(BaseModel):
    """A finished (non-streamed) chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None

"""What a finished request leaves behind: reply messages, turn records and usage.

Kept apart from the serving class so the streamed and the non-streamed paths build exactly
the same assistant message and the same token-exact `TurnRecord` for each sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from liveloop.contracts import TurnRecord, TurnTimings, TurnType
from liveloop.server.api.chat.protocol import ChatCompletionRequest
from liveloop.server.api.chat.sample import SampleState
from liveloop.server.prompting import BuiltPrompt
from liveloop.server.sessions import PreviousTurn, ServedSample, SessionTurn
from liveloop.server.tools import parse_tool_calls
from liveloop.server.tools.spec import ToolSpec


@dataclass
class PreparedChat:
    """A validated request, ready for the engine: prompt ids, sampling params, session."""

    request_id: str
    created: int
    model: str
    request: ChatCompletionRequest
    tenant: str
    turn_type: TurnType
    record: bool
    arrival: float
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    parse_tools: bool
    prompt: BuiltPrompt
    params: list[Any]
    previous: PreviousTurn | None = None
    session_hint: str | None = None  # X-Session-Id / metadata.session_id
    # The session this turn will belong to: the hint, the continued turn's, or a new id
    # (known before the engine starts, so an engine with replicas can route on it).
    session_key: str = ""
    session: SessionTurn | None = None  # set by open_session, once the engine has started
    headers: dict[str, str] = field(default_factory=dict)
    submitted: float = 0.0
    adapter: str | None = None  # the LoRA adapter it runs on (None: the base weights)
    # The functions the request offered: JSON naming one of them counts as a call too.
    offered_tools: list[ToolSpec] = field(default_factory=list)

    @property
    def turn(self) -> SessionTurn:
        """The session turn (after open_session)."""
        if self.session is None:
            raise RuntimeError("open_session has not run for this request")
        return self.session

    @property
    def want_logprobs(self) -> bool:
        """Whether the reply carries log-probs."""
        return bool(self.request.logprobs)


@dataclass
class FinishedSample:
    """The reply built from one finished sample."""

    message: dict[str, Any]
    finish_reason: str


# Engine finish reasons of a sample that was cut short rather than ended by the model.
TRUNCATED = frozenset({"length", "abort"})


def reply_finish_reason(engine_reason: str | None, called_tool: bool) -> str:
    """The reply's finish reason: "tool_calls" when the model called a tool and ended on
    its own; a reply cut short keeps "length" (or "abort") even with calls, as OpenAI does."""
    reason = engine_reason or "abort"
    return "tool_calls" if called_tool and reason not in TRUNCATED else reason


def finish_sample(
    sample: SampleState, parse_tools: bool, offered_tools: list[ToolSpec] | None = None
) -> FinishedSample:
    """The assistant message (text, or tool calls parsed from it) and the finish reason.

    With tools, a reply cut short inside a call never shows that call's markup as content.
    """
    text = sample.text
    reason = sample.finish_reason or "abort"
    if parse_tools:
        content, calls = parse_tool_calls(text, reason in TRUNCATED, offered_tools)
        if calls:
            return FinishedSample(
                {"role": "assistant", "content": content, "tool_calls": calls},
                reply_finish_reason(reason, True),
            )
        text = content or ""
    return FinishedSample({"role": "assistant", "content": text}, reason)


def turn_record(
    prep: PreparedChat, sample: SampleState, finished: FinishedSample, queued_s: float
) -> TurnRecord:
    """The token-exact record of one sample for `liveloop:turns`."""
    return TurnRecord(
        session_id=prep.turn.session_id,
        turn_index=prep.turn.turn_index,
        turn_type=prep.turn_type,
        tenant=prep.tenant,
        request_id=prep.request_id,
        sample_index=sample.index,
        messages=prep.messages,
        tools=prep.tools,
        response=finished.message,
        prompt_token_ids=prep.prompt.token_ids,
        completion_token_ids=list(sample.token_ids),
        logprobs=list(sample.logprobs),
        versions=list(sample.versions),
        adapter=prep.adapter,
        finish_reason=finished.finish_reason,
        model=prep.model,
        prompt_mode=prep.prompt.mode,
        timings=TurnTimings(
            queued_s=queued_s, time_to_first_token_s=sample.ttft(), total_s=sample.total()
        ),
    )


def served_sample(
    prep: PreparedChat, sample: SampleState, finished: FinishedSample
) -> ServedSample:
    """What the session store indexes so a follow-up can extend this sample."""
    return ServedSample(
        sample_index=sample.index,
        response=finished.message,
        prompt_token_ids=prep.prompt.token_ids,
        completion_token_ids=list(sample.token_ids),
    )


def usage(prep: PreparedChat, samples: list[SampleState]) -> dict[str, int]:
    """OpenAI usage block."""
    prompt = len(prep.prompt.token_ids)
    completion = sum(len(s.token_ids) for s in samples)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }

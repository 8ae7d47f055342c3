"""The `rules` judge: cheap pattern rules over what followed a turn.

Each new message after the turn gets a step score: a user reply that corrects the assistant
("no, that's wrong", "try again", "too long") scores `correction_score`, thanks or approval
scores `approval_score`, anything else `neutral_score`; a tool result that shows an error
(traceback, non-zero exit code, "error:") scores `tool_error_score`, else `tool_ok_score`.
The turn's score is the mean of its step scores. Explicit feedback gives its own score, and
a turn with no next state gets `timeout_score` (or no opinion when that is unset).

A reply that calls a tool again with the same arguments, when the conversation already
holds that call's result, scores `repeated_call_score` whatever follows: the tool's second
result would otherwise reward a model for never answering from the first.

The directive hint is what the user said the reply should have been: the sentences of their
reply that match a directive pattern ("Shorter, please: 20 words at most." out of "Shorter,
please: 20 words at most. Tell me about bees."), or the comment of explicit feedback.
"""

from __future__ import annotations

import json
import re
from typing import Any

from liveloop.config.prm import HINT_CHARS, RulesJudgeConfig
from liveloop.contracts import TOOL_ROLES, call_arguments_value
from liveloop.prm.judges.base import (
    JudgeBase,
    JudgeContext,
    JudgeRequest,
    JudgeResult,
    clean_hint,
    message_text,
)
from liveloop.written_calls import written_call

SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _compile(patterns: list[str]) -> re.Pattern[str] | None:
    if not patterns:
        return None
    return re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE | re.MULTILINE)


class RulesJudge(JudgeBase):
    """Regex rules for corrections, approval and tool errors; scores in [-1, 1]."""

    inline = True  # never awaits: the loop may run it without a task per turn
    name = "rules"
    settings_model = RulesJudgeConfig

    def __init__(self, context: JudgeContext | None = None) -> None:
        config = context.settings_as(RulesJudgeConfig) if context else RulesJudgeConfig()
        self.config = config
        self._hint_chars = context.hint_chars if context is not None else HINT_CHARS
        self._correction = _compile(config.correction_patterns)
        self._approval = _compile(config.approval_patterns)
        self._tool_error = _compile(config.tool_error_patterns)
        self._directive = _compile(config.directive_patterns)

    async def score(self, request: JudgeRequest) -> JudgeResult | None:
        """Score from feedback, else from the next messages, else the timeout score."""
        state = request.next_state
        if state.feedback is not None:
            return JudgeResult(
                score=state.feedback.score,
                hint="explicit feedback",
                directive_hint=clean_hint(state.feedback.comment, *self._hint_chars),
            )
        repeated = self._repeated_call(request)
        if repeated is not None:
            return repeated
        if state.messages is None:
            if self.config.timeout_score is None:
                return None
            return JudgeResult(score=self.config.timeout_score, hint="no next state")
        return self.score_messages(state.messages)

    def _repeated_call(self, request: JudgeRequest) -> JudgeResult | None:
        """`repeated_call_score` when the reply repeats a call whose result it was shown, or
        right after a tool result writes a call as text instead of answering."""
        score = self.config.repeated_call_score
        if score is None:
            return None
        calls = request.response.get("tool_calls")
        if not calls:
            return self._written_call(request, score)
        answered = answered_calls(request.messages)
        for call in calls:
            name, arguments = call_signature(call)
            if (name, arguments) in answered:
                hint = f"repeated tool call: {name} was already answered with these arguments"
                return self._repeated(score, name, hint)
        return None

    def _written_call(self, request: JudgeRequest, score: float) -> JudgeResult | None:
        messages = request.messages
        if not messages or messages[-1].get("role") not in TOOL_ROLES:
            return None  # only a reply right after a result; most replies stop here
        written = written_call(message_text(request.response))
        if written is None:
            return None
        answered = answered_calls(messages)
        if not answered:
            return None
        names = sorted({name for name, _ in answered})
        name = written if written in names else ", ".join(names)
        hint = f"a call written as text after the tool's result ({written!r})"
        return self._repeated(score, name, hint)

    def _repeated(self, score: float, name: str, hint: str) -> JudgeResult:
        directive = self.config.repeated_call_hint
        return JudgeResult(
            score=score,
            hint=hint,
            directive_hint=directive.replace("{name}", name) if directive else None,
        )

    def score_messages(self, messages: list[dict[str, Any]]) -> JudgeResult:
        """Step scores of the new messages and their mean."""
        steps: list[float] = []
        hints: list[str] = []
        for message in messages:
            score, hint = self._score_message(message)
            if score is None:
                continue
            steps.append(score)
            if hint:
                hints.append(hint)
        if not steps:
            return JudgeResult(score=self.config.neutral_score, hint="no user reply or tool result")
        mean = max(-1.0, min(1.0, sum(steps) / len(steps)))
        return JudgeResult(
            score=mean,
            step_scores=steps,
            hint="; ".join(hints) or None,
            directive_hint=self.directive_hint(messages),
        )

    def directive_hint(self, messages: list[dict[str, Any]]) -> str | None:
        """The sentences of the user's replies that say how the reply should have been."""
        if self._directive is None:
            return None
        said = [
            sentence
            for message in messages
            if message.get("role") == "user"
            for sentence in SENTENCE_END.split(message_text(message).strip())
            if self._directive.search(sentence)
        ]
        return clean_hint(" ".join(said), *self._hint_chars)

    def _score_message(self, message: dict[str, Any]) -> tuple[float | None, str | None]:
        role = message.get("role")
        text = message_text(message)
        if role in TOOL_ROLES:
            found = self._tool_error.search(text) if self._tool_error else None
            if found:
                return self.config.tool_error_score, f"tool error: {found.group(0).strip()!r}"
            return self.config.tool_ok_score, None
        if role != "user":
            return None, None
        found = self._correction.search(text) if self._correction else None
        if found:
            return self.config.correction_score, f"correction: {found.group(0).strip()!r}"
        found = self._approval.search(text) if self._approval else None
        if found:
            return self.config.approval_score, f"approval: {found.group(0).strip()!r}"
        return self.config.neutral_score, None


def call_signature(call: dict[str, Any]) -> tuple[str, str]:
    """A tool call's name and its arguments as canonical JSON (key order, spacing ignored)."""
    function = call.get("function") or {}
    arguments = json.dumps(call_arguments_value(function.get("arguments")), sort_keys=True)
    return str(function.get("name")), arguments


def answered_calls(messages: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """The calls of the conversation's assistant messages that a tool message answered."""
    by_id: dict[str, tuple[str, str]] = {}
    answered: set[tuple[str, str]] = set()
    for message in messages:
        if message.get("role") == "assistant":
            for call in message.get("tool_calls") or []:
                by_id[str(call.get("id"))] = call_signature(call)
        elif message.get("role") in TOOL_ROLES:
            signature = by_id.get(str(message.get("tool_call_id")))
            if signature is not None:
                answered.add(signature)
    return answered

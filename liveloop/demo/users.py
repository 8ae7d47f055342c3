"""Simulated users: concurrent multi-turn sessions, each with a hidden preference.

A user asks questions and reacts to each answer in natural language ("that makes no
sense", "too long, please be brief", "thanks, that's exactly it"), the way a person would
(`liveloop.demo.preferences`). The preference itself never reaches the model: it only sees
the conversation. The judging loop infers the reward from the user's next message exactly
as it would with people; a session's last reply, which no message follows, gets the
thumbs and comment the user leaves on the way out (`POST /v1/feedback`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from openai import APIError, AsyncOpenAI

from liveloop.demo.preferences import KNOWN_CITIES, Question, WordLimit
from liveloop.reading import letter_words
from liveloop.seeds import derived_seed
from liveloop.written_calls import written_call

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def run_tool(call: dict[str, Any]) -> str:
    """The fake weather tool: a result, or an error an agent's tool would print."""
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
        city = str(args["city"]).strip().lower()
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
        return f"error: bad arguments ({exc.__class__.__name__})"
    if city in KNOWN_CITIES:
        return f"{city.title()}: {KNOWN_CITIES[city]}"
    return f"error: unknown city {city[:40]!r} (exit code 1)"


@dataclass
class TurnLog:
    """One answered turn as the simulated user saw it."""

    user: int
    preference: str
    words: int
    tokens: int
    rating: float
    version: int
    at: float
    question: str = ""
    reply: str = ""
    reaction: str = ""
    reason: str = ""  # why the user reacted so (`Reaction.reason`: "pleased", "too_long", ...)
    tool_offered: bool = False  # a weather question, asked with the weather tool
    used_tool: bool = False  # the reply came after the model called the tool
    tool_result: str = ""  # what the tool returned, when it was called


@dataclass(frozen=True)
class ToolAsk:
    """A reply to a question asked with the weather tool offered, before its answer: the
    first reply, or one that followed a tool result (`after_result`); which version served
    it, whether it called the tool, and whether it wrote a call as text that the server did
    not take as one (`written`). Kept apart from `TurnLog`s, which are answers: a model that
    calls the tool again after every result never answers the question."""

    version: int
    called: bool
    after_result: bool = False
    written: bool = False


@dataclass
class UserStats:
    """Everything the population saw, for the report."""

    turns: list[TurnLog] = field(default_factory=list)
    tool_asks: list[ToolAsk] = field(default_factory=list)
    errors: int = 0


@dataclass
class UserRun:
    """How a population run talks to the server."""

    base_url: str
    model: str
    api_key: str = "none"
    max_tokens: int = 32
    turns_per_session: int = 3
    record: bool = True
    temperature: float = 1.0
    pace: Callable[[], Awaitable[None]] | None = None  # awaited before every request
    # Seeds every request's sampling from this, the user and the request's number, so that
    # two policies are compared on the same random draws (held-out users), and the same
    # policy gives the same replies again, bar a near-tie token now and then that a batch of
    # another size computes a last bit apart; None: unseeded.
    sample_seed: int | None = None
    # Times a user asks a question again after a reply it rated below 0 (its complaint and
    # the same question in one message) before it moves on; 0: each reaction comes with a
    # new question, so a complaint naming one topic arrives with a question on another.
    retries: int = 0


def _assistant_message(message: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in message.tool_calls
        ]
    return out


class SimulatedUser:
    """One user: opens sessions, asks, reacts, until the deadline."""

    def __init__(self, index: int, preference: WordLimit, run: UserRun, seed: int) -> None:
        self.index = index
        self.preference = preference
        self.run = run
        self.rng = random.Random(seed * 7919 + index)
        self.requests = 0  # asked so far: with `run.sample_seed`, each request's own seed
        self.client = AsyncOpenAI(base_url=run.base_url + "/v1", api_key=run.api_key, max_retries=2)

    async def _ask(
        self, session: str, messages: list[dict[str, Any]], with_tools: bool
    ) -> tuple[Any, int]:
        headers = {"X-Session-Id": session}
        if not self.run.record:
            headers["X-LiveLoop-Train"] = "false"
        extra: dict[str, Any] = {"tools": [WEATHER_TOOL]} if with_tools else {}
        if self.run.sample_seed is not None:
            extra["seed"] = derived_seed(self.run.sample_seed, self.index, self.requests)
        self.requests += 1
        raw = await self.client.chat.completions.with_raw_response.create(
            model=self.run.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=self.run.max_tokens,
            temperature=self.run.temperature,
            extra_headers=headers,
            **extra,
        )
        return raw.parse(), int(raw.headers.get("x-policy-version", "0"))

    def _answered(self, stats: UserStats) -> int:
        return sum(t.user == self.index for t in stats.turns)

    async def session(
        self, stats: UserStats, deadline: float, max_turns: int | None = None
    ) -> None:
        """One multi-turn session: ask, react to each answer, ask the next question."""
        session = f"demo-{uuid.uuid4().hex[:12]}"
        question = self.preference.ask(self.rng)
        messages: list[dict[str, Any]] = [{"role": "user", "content": question.text}]
        tool_result: str | None = None
        unanswered: TurnLog | None = None  # the last reply, while the user has not replied
        first_reply = True  # the next reply is the first to `question`
        retried = 0  # times `question` was asked again
        for _turn in range(self.run.turns_per_session):
            if time.monotonic() > deadline:
                break
            if max_turns is not None and self._answered(stats) >= max_turns:
                break
            if self.run.pace is not None:
                await self.run.pace()
            completion, version = await self._ask(session, messages, question.wants_tool)
            unanswered = None  # the request carried the user's reaction to it
            message = completion.choices[0].message
            if question.wants_tool and (first_reply or tool_result is not None):
                called = bool(message.tool_calls)
                written = not called and written_call(message.content or "") is not None
                ask = ToolAsk(version, called, after_result=not first_reply, written=written)
                stats.tool_asks.append(ask)
            first_reply = False
            messages.append(_assistant_message(message))
            if message.tool_calls and question.wants_tool:
                results = [run_tool(call) for call in messages[-1]["tool_calls"]]
                for call, result in zip(messages[-1]["tool_calls"], results, strict=True):
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
                tool_result = "; ".join(results)
                continue
            self._log(stats, question, message.content or "", completion, version, tool_result)
            unanswered = stats.turns[-1]
            if unanswered.rating < 0 and retried < self.run.retries:
                retried += 1  # the complaint, then the same question again
            else:
                question, retried = self.preference.ask(self.rng), 0
            tool_result, first_reply = None, True
            messages.append({"role": "user", "content": f"{unanswered.reaction} {question.text}"})
        if unanswered is not None and self.run.record:
            await self._leave_feedback(session, unanswered)

    async def _leave_feedback(self, session: str, turn: TurnLog) -> None:
        """On leaving, rate the last reply the way an app's thumbs and comment box would.

        Without it a session's last turn has no next state and is never judged. Like people,
        a pleased user leaves a thumb and no comment; the others say what was wrong (the
        comment becomes the turn's directive hint).
        """
        body: dict[str, Any] = {"session_id": session, "score": turn.rating}
        if turn.rating < 1.0:
            body["comment"] = turn.reaction
        with contextlib.suppress(APIError):
            await self.client.post("/feedback", cast_to=object, body=body)

    def _log(
        self,
        stats: UserStats,
        question: Question,
        reply: str,
        completion: Any,
        version: int,
        tool_result: str | None,
    ) -> None:
        reaction = self.preference.react(question, reply, self.rng, tool_result)
        tokens = completion.usage.completion_tokens if completion.usage else 0
        stats.turns.append(
            TurnLog(
                user=self.index,
                preference=self.preference.name,
                words=len(letter_words(reply)),
                tokens=tokens,
                rating=reaction.rating,
                version=version,
                at=time.time(),
                question=question.text,
                reply=reply,
                reaction=reaction.text,
                reason=reaction.reason,
                tool_offered=question.wants_tool,
                used_tool=tool_result is not None,
                tool_result=tool_result or "",
            )
        )

    async def live(self, stats: UserStats, deadline: float, max_turns: int | None = None) -> None:
        """Sessions until the deadline (or until `max_turns` answers were judged)."""
        try:
            while time.monotonic() < deadline:
                if max_turns is not None and self._answered(stats) >= max_turns:
                    return
                try:
                    await self.session(stats, deadline, max_turns)
                except APIError:
                    stats.errors += 1
                    await asyncio.sleep(1.0)
        finally:  # on every way out: a client left open is closed after its loop is gone
            await self.client.close()


async def run_population(
    run: UserRun,
    preferences: list[WordLimit],
    *,
    seconds: float,
    seed: int,
    max_turns_per_user: int | None = None,
    stats: UserStats | None = None,
) -> UserStats:
    """All users concurrently for `seconds` (or until each has `max_turns_per_user`).

    `stats` collects what they saw as it happens (pass one in to keep it if cancelled).
    """
    stats = stats if stats is not None else UserStats()
    deadline = time.monotonic() + seconds
    users = [SimulatedUser(i, p, run, seed) for i, p in enumerate(preferences)]
    await asyncio.gather(*(u.live(stats, deadline, max_turns_per_user) for u in users))
    return stats

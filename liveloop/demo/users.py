"""Simulated users: concurrent multi-turn sessions, each with a hidden preference.

A user asks questions and reacts to each answer in natural language ("too long, please be
brief", "thanks, that's exactly it"), the way a person would. The preference itself never
reaches the model: it only sees the conversation. The judging loop infers the reward from
the user's next message exactly as it would with people.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from openai import APIError, AsyncOpenAI

TOPICS = (
    "the ocean", "volcanoes", "bread", "the moon", "trains", "bees", "chess", "rain",
    "coffee", "glaciers", "owls", "bicycles", "maps", "tea", "clocks", "rivers",
)  # fmt: skip
QUESTIONS = (
    "Tell me about {t}.", "What should I know about {t}?", "Explain {t} to me.",
    "Give me a fact about {t}.", "Why do people like {t}?", "Describe {t}.",
)  # fmt: skip
APPROVALS = (
    "Thanks, that's exactly it.",
    "Perfect, thanks!",
    "Great, that's exactly what I wanted.",
)
CORRECTIONS = ("Too long, please be brief.", "No, that's too long. Try again, shorter.")
NEARLY = ("Hmm, a bit long.", "Okay, though a little shorter would be better.")
NEARLY_MARGIN = 4  # words over the limit that still get a lukewarm rather than a negative reply
TOOL_NUDGE = "No, that's wrong: please use the weather tool."

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
KNOWN_CITIES = {"paris": "sunny, 21 C", "oslo": "snow, -3 C", "lima": "cloudy, 17 C"}


def word_count(text: str | None) -> int:
    """Words as a person counts them: whitespace-separated pieces."""
    return len((text or "").split())


class Preference(Protocol):
    """What a user wants; hidden from the model."""

    name: str

    def react(self, reply: dict[str, Any], rng: random.Random) -> tuple[str, float]:
        """The user's next message and their own rating of the reply (+1, 0 or -1)."""
        ...


@dataclass
class MaxWords:
    """Wants answers of at most `limit` words."""

    limit: int
    name: str = "max_words"

    def react(self, reply: dict[str, Any], rng: random.Random) -> tuple[str, float]:
        """Thanks if short enough, lukewarm if nearly, else asks for brevity."""
        words = word_count(reply.get("content"))
        if words <= self.limit:
            return rng.choice(APPROVALS), 1.0
        if words <= self.limit + NEARLY_MARGIN:
            return rng.choice(NEARLY), 0.0
        return rng.choice(CORRECTIONS), -1.0


@dataclass
class ToolUser:
    """Wants the weather tool used; reports the tool's result when it is called."""

    limit: int
    name: str = "tool_user"

    def react(self, reply: dict[str, Any], rng: random.Random) -> tuple[str, float]:
        """After a tool result or a plain answer: judged by brevity, like MaxWords."""
        return MaxWords(self.limit).react(reply, rng)


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


@dataclass
class UserStats:
    """Everything the population saw, for the report."""

    turns: list[TurnLog] = field(default_factory=list)
    errors: int = 0


def make_population(n: int, seed: int, limits: tuple[int, ...] = (8, 10, 12)) -> list[Preference]:
    """A mix of brevity-minded users (word limits drawn from `limits`) and some tool users."""
    rng = random.Random(seed)
    people: list[Preference] = []
    for i in range(n):
        limit = rng.choice(limits)
        people.append(ToolUser(limit) if i % 8 == 7 else MaxWords(limit))
    return people


@dataclass
class UserRun:
    """How a population run talks to the server."""

    base_url: str
    model: str
    api_key: str = "none"
    max_tokens: int = 32
    turns_per_session: int = 2
    record: bool = True
    temperature: float = 1.0


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

    def __init__(self, index: int, preference: Preference, run: UserRun, seed: int) -> None:
        self.index = index
        self.preference = preference
        self.run = run
        self.rng = random.Random(seed * 7919 + index)
        self.client = AsyncOpenAI(base_url=run.base_url + "/v1", api_key=run.api_key, max_retries=2)

    def _question(self) -> str:
        return self.rng.choice(QUESTIONS).format(t=self.rng.choice(TOPICS))

    async def _ask(self, session: str, messages: list[dict[str, Any]]) -> tuple[Any, int]:
        headers = {"X-Session-Id": session}
        if not self.run.record:
            headers["X-LiveLoop-Train"] = "false"
        extra: dict[str, Any] = {}
        if isinstance(self.preference, ToolUser):
            extra["tools"] = [WEATHER_TOOL]
        raw = await self.client.chat.completions.with_raw_response.create(
            model=self.run.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=self.run.max_tokens,
            temperature=self.run.temperature,
            extra_headers=headers,
            **extra,
        )
        return raw.parse(), int(raw.headers.get("x-policy-version", "0"))

    async def session(self, stats: UserStats, deadline: float) -> None:
        """One multi-turn session."""
        session = f"demo-{uuid.uuid4().hex[:12]}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": self._question()}]
        for _turn in range(self.run.turns_per_session):
            if time.monotonic() > deadline:
                return
            completion, version = await self._ask(session, messages)
            message = completion.choices[0].message
            messages.append(_assistant_message(message))
            if message.tool_calls:
                for call in messages[-1]["tool_calls"]:
                    messages.append(
                        {"role": "tool", "tool_call_id": call["id"], "content": run_tool(call)}
                    )
                continue
            reaction, rating = self.preference.react({"content": message.content}, self.rng)
            tokens = completion.usage.completion_tokens if completion.usage else 0
            stats.turns.append(
                TurnLog(
                    self.index,
                    self.preference.name,
                    word_count(message.content),
                    tokens,
                    rating,
                    version,
                    time.time(),
                )
            )
            messages.append({"role": "user", "content": f"{reaction} {self._question()}"})

    async def live(self, stats: UserStats, deadline: float, max_turns: int | None = None) -> None:
        """Sessions until the deadline (or until `max_turns` answers were judged)."""
        try:
            while time.monotonic() < deadline:
                if (
                    max_turns is not None
                    and sum(t.user == self.index for t in stats.turns) >= max_turns
                ):
                    return
                try:
                    await self.session(stats, deadline)
                except APIError:
                    stats.errors += 1
                    await asyncio.sleep(1.0)
        finally:  # on every way out: a client left open is closed after its loop is gone
            await self.client.close()


async def run_population(
    run: UserRun,
    preferences: list[Preference],
    *,
    seconds: float,
    seed: int,
    max_turns_per_user: int | None = None,
) -> UserStats:
    """All users concurrently for `seconds` (or until each has `max_turns_per_user`)."""
    stats = UserStats()
    deadline = time.monotonic() + seconds
    users = [SimulatedUser(i, p, run, seed) for i, p in enumerate(preferences)]
    await asyncio.gather(*(u.live(stats, deadline, max_turns_per_user) for u in users))
    return stats

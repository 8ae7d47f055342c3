"""The contract of the promotion gate's probe sources, shared by the trainer and plugins.

A probe is a request the gate answers with each candidate's weights; a probe source draws
the set. The trainer ships two (`prompts`, `served`: `liveloop.trainer.safeguards.sources`),
and finds others by name in the `liveloop.probe_sources` entry-point group (the demo's held-
out users are one: `liveloop.demo.gate_probes`). A source subclasses `ProbeSource`.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import redis.asyncio as aredis

from liveloop.config import SharedSettings
from liveloop.config.gate import GateSettings

# How a probe's asker answers a reply (the next state its judges score), given a seeded rng.
Reactor = Callable[[str, random.Random], str]


@dataclass(frozen=True)
class Probe:
    """One probe request; `react` (when given) is how its asker answers the reply, and
    `topic` the word forms of what it asks about (for the topic rate)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    topic: frozenset[str] | None = None
    react: Reactor | None = field(default=None, compare=False)

    @classmethod
    def asking(cls, text: str, **kw: Any) -> Probe:
        """A probe of one user message."""
        return cls([{"role": "user", "content": text}], **kw)

    @property
    def question(self) -> str:
        """The last user message's text (what the probe asks)."""
        for message in reversed(self.messages):
            if message.get("role") == "user" and isinstance(message.get("content"), str):
                return str(message["content"])
        return ""


@dataclass(frozen=True)
class ProbeContext:
    """What a probe source may use: the gate's settings, the shared ones, the streams."""

    gate: GateSettings
    shared: SharedSettings
    redis: aredis.Redis | None = None
    tenant: str | None = None  # draw only this tenant's traffic (None: every tenant's)


class ProbeSource(ABC):
    """Draws the probe set; `refreshes` sources are asked again every few versions."""

    name: ClassVar[str]
    refreshes: ClassVar[bool] = False

    def __init__(self, context: ProbeContext) -> None:
        self.context = context

    @abstractmethod
    async def draw(self) -> list[Probe]:
        """The probe set to use from now on (may be empty: the gate then has no evidence)."""

    def fell_short(self, probes: list[Probe]) -> bool:
        """Whether `probes`, drawn earlier, are fewer than this source draws when it can (a
        refreshing source is then asked again before the next update, not every few
        versions: a trainer that starts before any traffic must not go unguarded)."""
        return False

    async def draw_more(self, taken: list[Probe]) -> list[Probe]:
        """Probes other than `taken`, for a second look when the set drawn gives doubtful
        evidence (the gate adds them to it); none by default."""
        return []

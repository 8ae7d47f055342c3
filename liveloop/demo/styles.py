"""House styles of the tenants demo: each tenant's users want their answers their own way.

`liveloop demo --tenants N` gives every tenant an API key of its own and users who all hold
that tenant's house style, and the styles conflict: one tenant wants answers of at most a
few words (`demo.brief_words`), the next wants at least three sentences that open by naming
the topic, the third asks about the weather and wants the weather tool used. One shared
policy is pulled both ways by the first two; a personal adapter per tenant need not be.
More tenants than styles repeat them in order. Like every simulated user, a tenant's users
first of all want a real answer (`liveloop.demo.preferences`).
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

from liveloop.demo.preferences import (
    WANTS_OPENING,
    Question,
    Reaction,
    WeatherAsker,
    WordLimit,
    say,
    sentences,
)
from liveloop.reading import ReplyReading, letter_words, mentions

WEATHER_WORDS = 25  # the word limit of the weather tenant's users, for answers from the tool
EXPLAINED_SENTENCES = 3  # the explained tenant's fewest sentences
NO_LIMIT = 10**6
WANTS_MORE = (
    "Please explain more: at least three sentences.", "That's too short, tell me more about {t}.",
    "Can you explain {t} properly, in a few sentences?",
)  # fmt: skip


@dataclass
class Explained(WordLimit):
    """Wants an explanation: opening by naming the topic, at least three sentences."""

    limit: int = NO_LIMIT
    name: str = "explained"

    def wish(
        self, question: Question, reply: str, reading: ReplyReading, rng: random.Random
    ) -> Reaction | None:
        """The topic named in the first three words, then enough sentences."""
        topic = question.topic
        if topic is not None and not mentions(letter_words(reply)[:3], topic.forms):
            return Reaction(say(rng, WANTS_OPENING, t=topic.name), -1.0, "opening")
        if sentences(reply) < EXPLAINED_SENTENCES:
            return Reaction(say(rng, WANTS_MORE, t=topic.name if topic else "it"), -1.0, "short")
        return None


def house_style(index: int, strict: bool, brief_words: int) -> WordLimit:
    """The house style of tenant `index`: brief (at most `brief_words` words), explained,
    weather, brief, ..."""
    kind = index % 3
    if kind == 0:
        return WordLimit(brief_words, strict=strict, name="brief")
    if kind == 1:
        return Explained(strict=strict)
    return WeatherAsker(WEATHER_WORDS, strict=strict)


@dataclass
class Tenant:
    """One tenant of the demo: its API key (its key id is the tenant) and its users."""

    index: int
    style: str
    api_key: str
    people: list[WordLimit] = field(default_factory=list)

    @property
    def label(self) -> str:
        """How the report names it: its number and its style."""
        return f"tenant {self.index + 1} ({self.style})"


def make_tenants(
    count: int,
    users: int,
    *,
    brief_words: int,
    strict: bool = True,
    users_per_style: Mapping[str, int] | None = None,
) -> list[Tenant]:
    """`count` tenants with fresh API keys, every user of a tenant holding its house style
    (the users' seed decides what they ask). With `users_per_style`, each tenant has that
    many users for its style; without, `users` are shared out in turn (at least one each)."""
    tenants = [
        Tenant(i, house_style(i, strict, brief_words).name, "demo-" + secrets.token_urlsafe(12))
        for i in range(count)
    ]
    if users_per_style:
        for tenant in tenants:
            tenant.people = [
                house_style(tenant.index, strict, brief_words)
                for _ in range(users_per_style[tenant.style])
            ]
        return tenants
    for u in range(max(users, count)):
        tenant = tenants[u % count]
        tenant.people.append(house_style(tenant.index, strict, brief_words))
    return tenants

"""What simulated users ask, what they want, and how they say what they think of a reply.

Each user holds a hidden preference: a word limit, plus for some an opening they want
(name the thing first), a format (one sentence) or, for weather questions, the weather
tool. The preference never reaches the model; it shows only in how the user reacts, in
natural and varied words, the way people do. Before any preference, a reply must be an
answer at all: real English words about what was asked, not symbols, markup or repeated
fragments (`liveloop.reading`), about the topic asked rather than another one the users
ask about, and something said about it beyond naming it ("Bread. 30 words." names the topic
and echoes a word limit; it says nothing). Nonsense gets a complaint, never thanks.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Any

from liveloop.reading import (
    MIN_CONTENT_WORDS,
    ReplyReading,
    letter_words,
    mentions,
    read_reply,
)
from liveloop.written_calls import written_call


@dataclass(frozen=True)
class Topic:
    """Something users ask about, and the word forms that show a reply is about it."""

    name: str
    forms: frozenset[str]
    min_content: int = MIN_CONTENT_WORDS  # content words an answer needs (0: any will do)


def _topic(name: str, forms: str) -> Topic:
    return Topic(name, frozenset(forms.split()))


TOPICS = (
    _topic("the ocean", "ocean oceans sea seas marine waves ocean's"),
    _topic("volcanoes", "volcano volcanoes volcanic lava magma eruption eruptions erupt erupts"),
    _topic("bread", "bread breads dough flour loaf loaves baking baked bake"),
    _topic("the moon", "moon moons lunar moon's"),
    _topic("trains", "train trains railway railways rail rails locomotive locomotives railroad"),
    _topic("bees", "bee bees honey hive hives pollen pollinate pollinator pollinators beehive"),
    _topic("chess", "chess pawn pawns chessboard checkmate"),
    _topic("rain", "rain rains rainfall raining rainy raindrops precipitation"),
    _topic("coffee", "coffee coffees caffeine espresso beans brew brewed"),
    _topic("glaciers", "glacier glaciers glacial ice icy"),
    _topic("owls", "owl owls nocturnal"),
    _topic("bicycles", "bicycle bicycles bike bikes cycling cyclist cyclists pedal pedals"),
    _topic("maps", "map maps mapping cartography atlas atlases"),
    _topic("tea", "tea teas leaves brew brewed"),
    _topic("clocks", "clock clocks timekeeping clockwork"),
    _topic("rivers", "river rivers stream streams riverbank"),
)


def rivals_of(topic: Topic | None) -> tuple[frozenset[str], ...]:
    """The forms of the other topics users ask about, which must not lead an answer about
    `topic` (none for a topic not in the list, such as a weather result's facts)."""
    if topic not in TOPICS:
        return ()
    return tuple(other.forms for other in TOPICS if other != topic)


QUESTION_FORMS = (
    "Tell me about {t}.", "What should I know about {t}?", "Explain {t} to me.",
    "Give me a fact about {t}.", "Why do people like {t}?", "Describe {t}.",
)  # fmt: skip
WEATHER_FORMS = (
    "What's the weather in {c} right now?", "Is it cold in {c} today?",
    "How is the weather in {c}?",
)  # fmt: skip
KNOWN_CITIES = {"paris": "sunny, 21 C", "oslo": "snow, -3 C", "lima": "cloudy, 17 C"}

APPROVALS = (
    "Thanks, that's exactly it.", "Perfect, thanks!", "Great, that's what I wanted.",
    "Nice, thank you.", "That's right, thanks.",
)  # fmt: skip
LUKEWARM = ("Hmm, a bit long.", "Okay, though a little shorter would be better.", "Fine, I guess.")
COMPLAINTS = {
    "nonsense": (
        "That makes no sense.", "What? That doesn't make any sense.",
        "I can't understand that at all; please answer in plain English.", "That's gibberish.",
    ),
    "symbols": (
        "That's just a bunch of symbols, not an answer.", "That makes no sense.",
        "Why all the symbols? Answer in plain words.",
    ),
    "foreign": (
        "I can't understand that at all; please answer in plain English.",
        "That's not English, I can't read it. Please answer in plain English.",
    ),
    "markup": ("That's formatting junk, not an answer.", "Please answer in plain words, no markup."),
    "repetitive": (
        "You're repeating yourself, that makes no sense.", "That's the same words over and over.",
    ),
    "off_topic": (
        "You didn't answer my question.", "That's not what I asked about: I asked about {t}.",
        "Please stay on topic, I asked about {t}.",
    ),
    "thin": (
        "That doesn't tell me anything about {t}.", "That says nothing. Tell me something about {t}.",
        "That's not much of an answer; say more about {t}.",
    ),
}  # fmt: skip
TOO_LONG = (
    "Too long, please be brief.", "No, that's too long. Try again, shorter.",
    "Shorter, please: {n} words at most.", "That's more than I need, keep it short.",
    "Can you say that in fewer words?", "Too wordy. Keep it under {n} words, please.",
)  # fmt: skip
WANTS_OPENING = (
    "Please start by naming {t} first.", "Begin your answer with {t} itself, please.",
    "Start with what {t} is, not with filler.",
)  # fmt: skip
WANTS_ONE_SENTENCE = (
    "Just one sentence, please.", "Please answer in a single sentence.",
    "Keep it to one sentence next time.",
)  # fmt: skip
WANTS_TOOL = (
    "Please use the weather tool, I want the real weather.",
    "No, that's wrong: please use the weather tool.", "Check with the weather tool first, please.",
)  # fmt: skip
WRONG_WEATHER = (
    "That's not what the weather tool said.",
    "No, that's wrong, read the tool result.",
)
NO_ANSWER_AFTER_RESULT = (
    "You have the tool's result, just tell me the weather in words.",
    "That's a tool call, not an answer. What does the result say?",
)
WANTS_TEMPERATURE = (
    "And how warm is it there?", "OK, but what's the temperature?",
    "But how many degrees is it?",
)  # fmt: skip
NEARLY_MARGIN = 4  # words over the limit that still get a lukewarm rather than a negative reply


@dataclass(frozen=True)
class Question:
    """One question; weather questions come with the weather tool offered."""

    text: str
    topic: Topic | None = None
    city: str | None = None

    @property
    def wants_tool(self) -> bool:
        """True for a weather question (the weather tool is offered with it)."""
        return self.city is not None


@dataclass(frozen=True)
class Reaction:
    """A user's next message and their own rating (+1 pleased, 0 lukewarm, -1 not)."""

    text: str
    rating: float
    reason: str


def say(rng: random.Random, options: tuple[str, ...], **fill: Any) -> str:
    """One of `options`, chosen by `rng`, with its placeholders filled in."""
    return rng.choice(options).format(**fill)


def sentences(text: str) -> int:
    """Sentences in a reply (pieces ending in . ! or ? that hold a word)."""
    parts = [p for p in text.replace("!", ".").replace("?", ".").split(".") if letter_words(p)]
    return len(parts)


@dataclass
class WordLimit:
    """Wants answers of at most `limit` real words (and, first of all, a real answer)."""

    limit: int
    strict: bool = True  # False: only the preference counts (for a model with no language)
    name: str = "word_limit"

    def ask(self, rng: random.Random) -> Question:
        """A question about one of the topics."""
        topic = rng.choice(TOPICS)
        return Question(rng.choice(QUESTION_FORMS).format(t=topic.name), topic=topic)

    def react(
        self, question: Question, reply: str, rng: random.Random, tool_result: str | None = None
    ) -> Reaction:
        """Complaint for a non-answer, then this user's own wish, then the word limit."""
        topic_asked = question.topic
        reading = read_reply(
            reply,
            topic_asked.forms if topic_asked else None,
            min_content=topic_asked.min_content if topic_asked else 0,
            rivals=rivals_of(topic_asked),
        )
        topic = topic_asked.name if topic_asked else "that"
        if self.strict and reading.problem is not None:
            return Reaction(say(rng, COMPLAINTS[reading.problem], t=topic), -1.0, reading.problem)
        wish = self.wish(question, reply, reading, rng)
        if wish is not None:
            return wish
        if reading.words <= self.limit:
            return Reaction(say(rng, APPROVALS), 1.0, "pleased")
        if reading.words <= self.limit + NEARLY_MARGIN:
            return Reaction(say(rng, LUKEWARM), 0.0, "nearly")
        return Reaction(say(rng, TOO_LONG, n=self.limit), -1.0, "too_long")

    def wish(
        self, question: Question, reply: str, reading: ReplyReading, rng: random.Random
    ) -> Reaction | None:
        """A correction for this user's extra wish, or None when it is met (none here)."""
        return None


@dataclass
class Opening(WordLimit):
    """Also wants the answer to open by naming the thing asked about."""

    name: str = "opening"

    def wish(
        self, question: Question, reply: str, reading: ReplyReading, rng: random.Random
    ) -> Reaction | None:
        """The first three words must name the topic."""
        if question.topic is None or mentions(letter_words(reply)[:3], question.topic.forms):
            return None
        return Reaction(say(rng, WANTS_OPENING, t=question.topic.name), -1.0, "opening")


@dataclass
class OneSentence(WordLimit):
    """Also wants a single sentence."""

    name: str = "one_sentence"

    def wish(
        self, question: Question, reply: str, reading: ReplyReading, rng: random.Random
    ) -> Reaction | None:
        """More than one sentence gets a correction."""
        if sentences(reply) <= 1:
            return None
        return Reaction(say(rng, WANTS_ONE_SENTENCE), -1.0, "one_sentence")


@dataclass
class WeatherAsker(WordLimit):
    """Asks about the weather and wants the weather tool used, then a short true answer that
    answers the question: the result's weather and its temperature ("snow" alone is half an
    answer, lukewarm; a temperature other than the result's is wrong)."""

    name: str = "weather_tool"

    def ask(self, rng: random.Random) -> Question:
        """A weather question about one of the known cities."""
        city = rng.choice(sorted(KNOWN_CITIES))
        return Question(rng.choice(WEATHER_FORMS).format(c=city.title()), city=city)

    def react(
        self, question: Question, reply: str, rng: random.Random, tool_result: str | None = None
    ) -> Reaction:
        """Before the tool was used: ask for it. After: the answer must match the result."""
        if question.city is None:
            return super().react(question, reply, rng)
        if tool_result is None:
            return Reaction(say(rng, WANTS_TOOL), -1.0, "no_tool")
        if written_call(reply) is not None:
            return Reaction(say(rng, NO_ANSWER_AFTER_RESULT), -1.0, "written_call")
        facts = frozenset(letter_words(KNOWN_CITIES[question.city].lower()))
        weather = Question(question.text, topic=Topic("the weather", facts, 0))
        reaction = super().react(weather, reply, rng)
        if reaction.reason == "off_topic":
            return Reaction(say(rng, WRONG_WEATHER), -1.0, "wrong_weather")
        if reaction.reason in COMPLAINTS:  # no answer at all: that comes first
            return reaction
        stated = temperature_stated(reply, KNOWN_CITIES[question.city])
        if stated is False:
            return Reaction(say(rng, WRONG_WEATHER), -1.0, "wrong_weather")
        if stated is None and reaction.rating >= 0:
            return Reaction(say(rng, WANTS_TEMPERATURE), 0.0, "no_temperature")
        return reaction


NUMBER = re.compile(r"(?<![\w.])(minus\s+|[-\u2212]\s?)?(\d+)(?!\d)", re.I)


def temperature_stated(reply: str, result: str) -> bool | None:
    """Whether the reply states the result's temperature ("-3", "minus 3", "3 degrees below
    zero" for -3 C): True, False when it states only other numbers, None when no number."""
    expected = int(re.findall(r"-?\d+", result)[-1])
    numbers = [(-1 if sign else 1) * int(n) for sign, n in NUMBER.findall(reply)]
    if not numbers:
        return None
    below = expected < 0 and re.search(r"\bbelow\b", reply, re.I) is not None
    return expected in numbers or (below and -expected in numbers)


def make_population(
    n: int,
    seed: int,
    limits: tuple[int, ...] = (8, 10, 12),
    *,
    strict: bool = True,
    weather_share: float | None = None,
) -> list[WordLimit]:
    """A mix: mostly word limits alone, some wanting an opening or one sentence, some weather.

    `strict=False` gives users who judge a word limit alone, for a model that has no
    language at all (a randomly initialised one, used to exercise the pipeline).
    `weather_share` is the share of weather users, spread evenly (None: one in eight).
    """
    share = 1 / 8 if weather_share is None else weather_share
    rng = random.Random(seed)
    kinds: tuple[type[WordLimit], ...] = (WordLimit, WordLimit, Opening, WordLimit, OneSentence)
    people: list[WordLimit] = []
    for i in range(n):
        limit = rng.choice(limits)
        if not strict:
            people.append(WordLimit(limit, strict=False))
            continue
        asks_weather = math.floor((i + 1) * share + 1e-9) > math.floor(i * share + 1e-9)
        kind = WeatherAsker if asks_weather else kinds[i % len(kinds)]
        people.append(kind(limit))
    return people

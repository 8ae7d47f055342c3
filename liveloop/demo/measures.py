"""Quality measures of a set of replies to known questions, for the demo's report.

Reward alone can rise while replies decay. Beside it the report shows, for the replies of
each version (served, or to held-out users): how often a reply mentions the topic of the
question it answers, how many replies are dominated by symbols or markup, how many are no
answer at all (nonsense, repeats), their length in words and their distinct-2.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from liveloop.demo.language import distinct_n, read_reply
from liveloop.demo.preferences import TOPICS, Topic


def topic_of(question: str) -> Topic | None:
    """The topic a user message asks about (the last one named: reactions come first)."""
    lowered = question.lower()
    found = [(lowered.rfind(t.name), t) for t in TOPICS if t.name in lowered]
    return max(found, key=lambda pair: pair[0])[1] if found else None


def _share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def reply_quality(pairs: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """Measures over (question, reply) pairs: topic rate, symbol and nonsense shares, words."""
    pairs = list(pairs)
    readings = []
    for question, reply in pairs:
        topic = topic_of(question)
        readings.append(read_reply(reply, topic.forms if topic else None))
    topical = [r.on_topic for r in readings if r.on_topic is not None]
    return {
        "topic_rate": _share(topical),
        "symbol_share": _share([r.dominated_by_symbols for r in readings]),
        "non_answer_share": _share([r.no_answer for r in readings if r.words or r.symbol_share]),
        "mean_words": sum(r.words for r in readings) / len(readings) if readings else None,
        "distinct_2": distinct_n(reply for _q, reply in pairs),
    }

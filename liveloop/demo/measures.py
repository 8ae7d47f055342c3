"""Quality measures of a set of replies to known questions, for the demo's report.

Reward alone can rise while replies decay. Beside it the report shows, for the replies of
each version (served, or to held-out users): how often a reply mentions the topic of the
question it answers, how many replies are dominated by symbols or markup, how many are no
answer at all (nonsense, repeats), their length in words and their distinct-2. And what
the users themselves said, early and late: which of their wishes the replies still miss.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from liveloop.demo.preferences import TOPICS, Topic, rivals_of
from liveloop.reading import distinct_n, letter_words, read_reply
from liveloop.written_calls import written_call

if TYPE_CHECKING:
    from liveloop.demo.users import ToolAsk, TurnLog


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
        readings.append(read_reply(reply, topic.forms if topic else None, rivals=rivals_of(topic)))
    topical = [r.on_topic for r in readings if r.on_topic is not None]
    return {
        "topic_rate": _share(topical),
        "symbol_share": _share([r.dominated_by_symbols for r in readings]),
        "non_answer_share": _share([r.no_answer for r in readings if r.words or r.symbol_share]),
        "mean_words": sum(r.words for r in readings) / len(readings) if readings else None,
        "distinct_2": distinct_n(reply for _q, reply in pairs),
    }


def _reason_shares(answers: Sequence[TurnLog]) -> dict[str, float]:
    counts = Counter(a.reason for a in answers)
    return {reason: n / len(answers) for reason, n in counts.most_common()}


def _uses(reply: str, result: str) -> bool:
    """The reply names the weather the tool reported (a word of the result after the city)
    and is not a call written as text (whose arguments may repeat the result)."""
    if written_call(reply) is not None:
        return False
    facts = set(letter_words(result.partition(":")[2].lower()))
    return bool(facts & {w.lower() for w in letter_words(reply)})


def tool_use_by_version(
    answers: Sequence[TurnLog], asks: Sequence[ToolAsk]
) -> dict[str, dict[str, Any]]:
    """Per policy version, of the weather questions: how many it got first, the share of
    those its first reply was a call to the weather tool; of its replies that followed a
    tool result, the share that called the tool again (a call written as text included),
    and how many replies wrote a call as text; of the weather questions it
    answered: how many, the share answered after a call, and the share of those whose
    answer used the tool's result (it named the weather the tool reported)."""
    out: dict[str, dict[str, Any]] = {}
    versions = {a.version for a in answers if a.tool_offered} | {k.version for k in asks}
    for version in sorted(versions):
        mine = [k for k in asks if k.version == version and not k.after_result]
        after = [k for k in asks if k.version == version and k.after_result]
        weather = [a for a in answers if a.tool_offered and a.version == version]
        called = [a for a in weather if a.used_tool]
        out[str(version)] = {
            "questions": len(mine),
            "tool_call_rate": _share([k.called for k in mine]),
            "after_result": len(after),
            "recall_rate": _share([k.called or k.written for k in after]),
            "written_calls": sum(k.written for k in [*mine, *after]),
            "answers": len(weather),
            "answered_after_call_rate": _share([a.used_tool for a in weather]),
            "used_result_rate": _share([_uses(a.reply, a.tool_result) for a in called]),
        }
    return out


def user_reactions(
    answers: Sequence[TurnLog], window: int, asks: Sequence[ToolAsk]
) -> dict[str, Any]:
    """Why the users reacted as they did, in their first and last `window` answers.

    Each answer has one reason (the first thing wrong the user found, or "pleased"), so the
    shares say where reward is still lost. Weather questions show whether the model called
    the tool (`asks`: each weather question's first reply) and answered after it: a user who
    wants it is never pleased without it.
    """
    ordered = sorted(answers, key=lambda a: a.at)
    window = max(1, min(window, len(ordered) // 2))
    weather = [a for a in ordered if a.tool_offered]
    return {
        "window": window,
        "first": _reason_shares(ordered[:window]) if ordered else {},
        "last": _reason_shares(ordered[-window:]) if ordered else {},
        "weather_questions": sum(not k.after_result for k in asks),
        "questions_called": sum(k.called for k in asks if not k.after_result),
        "weather_answers": len(weather),
        "answers_after_tool": sum(a.used_tool for a in weather),
        "tool_use": tool_use_by_version(ordered, asks),
    }

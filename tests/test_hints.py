"""Directive hints from judges: the rules judge, feedback, the LLM judge's vote parsing, the
panel, the scored stream (marked hinted) and the collector (carried into the batch)."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from liveloop.collector.advantages import PendingSample
from liveloop.contracts import Feedback
from liveloop.demo.preferences import TOO_LONG, WANTS_ONE_SENTENCE, WANTS_OPENING, WANTS_TOOL
from liveloop.demo.styles import WANTS_MORE
from liveloop.prm.judges import (
    JudgeBase,
    JudgeError,
    JudgeRequest,
    JudgeResult,
    NextState,
    validate_result,
)
from liveloop.prm.judges.feedback import FeedbackJudge
from liveloop.prm.judges.llm import parse_hint, parse_vote
from liveloop.prm.judges.rules import RulesJudge
from liveloop.prm.metrics import PrmMetrics
from liveloop.prm.panel import JudgePanel
from tests.synthetic import conversation, make_turn, user, write_turns
from tests.test_prm_loop import count_is, fast_settings, judging, scored, wait_for


def request_with(messages: list[dict[str, Any]] | None, feedback: Feedback | None = None) -> Any:
    turn = make_turn("s", 0, [user("Tell me about bees.")], "Bees are insects that " * 10)
    return JudgeRequest.for_turn(turn, NextState(messages=messages, feedback=feedback))


@pytest.mark.parametrize(
    "phrasing", [*TOO_LONG, *WANTS_OPENING, *WANTS_ONE_SENTENCE, *WANTS_TOOL, *WANTS_MORE]
)
async def test_rules_hint_is_what_the_user_said_the_reply_should_have_been(phrasing: str) -> None:
    correction = phrasing.format(n=20, t="bees")
    # what a simulated user sends: the correction, then the next question
    result = await RulesJudge().score(request_with([user(f"{correction} Describe trains.")]))
    assert result is not None and result.score == -1.0
    assert result.directive_hint is not None
    assert "trains" not in result.directive_hint
    assert result.directive_hint in correction  # whole sentences of the correction


@pytest.mark.parametrize(
    "text",
    [
        "Thanks, that's exactly it. Tell me about owls.",
        "That makes no sense.",
        "ok",
        "Describe tea.",
    ],
)
async def test_no_rules_hint_without_a_directive(text: str) -> None:
    result = await RulesJudge().score(request_with([user(text)]))
    assert result is not None and result.directive_hint is None


async def test_feedback_comment_is_the_hint() -> None:
    comment = "Please answer with the city name first."
    feedback = Feedback(session_id="s", turn_index=0, score=-1, tenant="t", comment=comment)
    for judge in (FeedbackJudge(), RulesJudge()):
        result = await judge.score(request_with(None, feedback))
        assert result is not None and result.directive_hint == comment
    terse = Feedback(session_id="s", turn_index=0, score=1, tenant="t", comment="ok")
    result = await FeedbackJudge().score(request_with(None, terse))
    assert result is not None and result.directive_hint is None


class FixedJudge(JudgeBase):
    """A judge that returns whatever it was given."""

    def __init__(self, name: str, result: JudgeResult | None) -> None:
        self.name = name
        self.result = result

    async def score(self, request: JudgeRequest) -> JudgeResult | None:
        return self.result


async def test_panel_keeps_the_longest_hint_cleaned_and_cut() -> None:
    long = "Answer in one short sentence that names the city first, " * 10
    metrics = PrmMetrics(CollectorRegistry())
    judges: list[tuple[Any, float]] = [
        (FixedJudge("a", JudgeResult(score=1.0, directive_hint="  Be   brief, please. ")), 1.0),
        (FixedJudge("b", JudgeResult(score=-1.0, directive_hint="ok")), 1.0),
        (FixedJudge("c", JudgeResult(score=0.0)), 1.0),
    ]
    panel = JudgePanel(judges, metrics, hint_chars=(10, 60))
    verdict = await panel.judge(request_with([user("hi")]))
    assert verdict is not None and verdict.directive_hint == "Be brief, please."
    judges.append((FixedJudge("d", JudgeResult(score=0.0, directive_hint=long)), 1.0))
    verdict = await JudgePanel(judges, metrics, hint_chars=(10, 60)).judge(request_with([]))
    assert verdict is not None and verdict.directive_hint is not None
    assert len(verdict.directive_hint) <= 60 and long.startswith(verdict.directive_hint)
    hinted = metrics.registry.get_sample_value(
        "liveloop_prm_directive_hints_total", {"judge": "final"}
    )
    assert hinted == 2.0
    with pytest.raises(JudgeError, match="directive_hint"):
        validate_result("x", JudgeResult(score=0.0, directive_hint=3))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "vote", "hint"),
    [
        ("GOOD", 1.0, None),
        (
            "BAD\n[HINT]Answer in two sentences at most.[/HINT]",
            -1.0,
            "Answer in two sentences at most.",
        ),
        (
            "BAD [hint] A good answer names the city first.",
            -1.0,
            "A good answer names the city first.",
        ),
        ("[HINT]Be brief.[/HINT] Verdict: neutral", 0.0, "Be brief."),
        ('{"verdict": "BAD", "hint": "Use the weather tool."}', -1.0, "Use the weather tool."),
        ('{"verdict": "GOOD", "hint": ""}', 1.0, None),
        ("[HINT]good or bad[/HINT]", None, "good or bad"),
    ],
)
def test_llm_vote_and_hint_parsing(text: str, vote: float | None, hint: str | None) -> None:
    rest, found = parse_hint(text)
    assert found == hint
    assert parse_vote(rest) == vote


async def test_scored_turns_are_marked_hinted_and_batches_carry_the_hint(
    aredis_client: aredis.Redis, redis_url: str
) -> None:
    turns = conversation(
        "h",
        [
            user("Tell me about bees."),
            user("Too wordy. Keep it under 8 words, please. Describe trains."),
            user("Thanks, that's exactly it. Describe tea."),
        ],
    )
    async with judging(aredis_client, fast_settings(redis_url)):
        await write_turns(aredis_client, turns)
        await wait_for(lambda: count_is(aredis_client, "liveloop:scored", 2))
    entries = await aredis_client.xrange("liveloop:scored")
    marks = {f["turn_index"]: f["hinted"] for _id, f in entries}
    assert marks["0"] == "1" and marks["1"] == "0"
    got = {s.turn_index: s for s in await scored(aredis_client)}
    assert got[0].directive_hint == "Too wordy. Keep it under 8 words, please."
    assert got[1].directive_hint is None
    sample = PendingSample("1-0", got[0], 0.0).to_batch_sample()
    assert sample.hint is not None and sample.hint.text == got[0].directive_hint
    assert sample.hint.messages == got[0].messages
    assert PendingSample("1-1", got[1], 0.0).to_batch_sample().hint is None

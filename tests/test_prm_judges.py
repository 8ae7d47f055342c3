"""Judges without Redis: next-state extraction, rules, vote parsing, validation, the panel."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, Field

from liveloop.config import ConfigError, load_settings
from liveloop.config.defaults import ANSWER_FROM_RESULT
from liveloop.contracts import Feedback, ScoredTurn
from liveloop.prm.judges import (
    Judge,
    JudgeBase,
    JudgeContext,
    JudgeError,
    JudgeRequest,
    JudgeResult,
    NextState,
    TurnHead,
    judge_context,
    load_judges,
)
from liveloop.prm.judges.feedback import FeedbackJudge
from liveloop.prm.judges.llm import majority, parse_vote
from liveloop.prm.judges.rules import RulesJudge
from liveloop.prm.metrics import PrmMetrics
from liveloop.prm.nextstate import new_messages
from liveloop.prm.panel import JudgePanel
from liveloop.prm.scorer import make_scored, scored_fields
from tests.synthetic import conversation, make_turn, tool, user


def request_with(
    messages: list[dict[str, Any]] | None, feedback: Feedback | None = None
) -> JudgeRequest:
    turn = make_turn("s", 0, [user("question")], "reply")
    return JudgeRequest.for_turn(turn, NextState(messages=messages, feedback=feedback))


def fb(score: float) -> Feedback:
    return Feedback(session_id="s", turn_index=0, score=score, tenant="t", comment="from a user")


def test_new_messages_follow_the_previous_request_and_reply() -> None:
    turns = conversation("s", [user("a"), [tool("out 1", "c1"), tool("out 2", "c2")], user("b")])
    assert new_messages(turns[0].messages, turns[1].messages) == [
        tool("out 1", "c1"),
        tool("out 2", "c2"),
    ]
    assert new_messages(turns[1].messages, turns[2].messages) == [user("b")]
    # A client that trimmed its history: the messages after the last assistant message.
    trimmed = [{"role": "assistant", "content": "x"}, user("thanks")]
    assert new_messages(turns[1].messages, trimmed) == [user("thanks")]


@pytest.mark.parametrize(
    ("messages", "score", "hint"),
    [
        ([user("No, that's wrong.")], -1.0, "correction"),
        ([user("please try again")], -1.0, "correction"),
        ([user("way too long")], -1.0, "correction"),
        ([user("Thanks, perfect!")], 1.0, "approval"),
        ([user("exactly what I needed")], 1.0, "approval"),
        ([user("thanks, but that's not what I asked")], -1.0, "correction"),
        ([user("and how do I deploy it?")], 0.0, None),
        ([tool("Traceback (most recent call last):\n  ...\nKeyError: 'x'")], -1.0, "tool error"),
        ([tool("process exited with code 2")], -1.0, "tool error"),
        ([tool("error: file not found")], -1.0, "tool error"),
        ([tool("exit code 0\nall good")], 0.25, None),
    ],
)
async def test_rules_judge_patterns(
    messages: list[dict[str, Any]], score: float, hint: str | None
) -> None:
    result = await RulesJudge().score(request_with(messages))
    assert result is not None
    assert result.score == pytest.approx(score)
    assert result.step_scores == [pytest.approx(score)]
    assert (result.hint or "").startswith(hint) if hint else result.hint is None


async def test_rules_judge_steps_feedback_and_timeout() -> None:
    judge = RulesJudge()
    mixed = await judge.score(request_with([tool("ok"), tool("error: boom")]))
    assert mixed is not None and mixed.step_scores == [0.25, -1.0]
    assert mixed.score == pytest.approx(-0.375)
    from_feedback = await judge.score(request_with(None, fb(0.4)))
    assert from_feedback is not None and from_feedback.score == 0.4
    assert await judge.score(request_with(None)) is None  # silence: no opinion by default
    settings = load_settings(prm={"rules": {"timeout_score": 0.0}})
    timed_out = await RulesJudge(judge_context("rules", settings.prm, settings.shared())).score(
        request_with(None)
    )
    assert timed_out is not None and timed_out.score == 0.0


def _call(call_id: str, city: str, spacing: str = " ") -> dict[str, Any]:
    arguments = '{"city":' + spacing + json.dumps(city) + ', "units": "metric"}'
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip


def _called(*calls: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


async def test_a_call_repeated_after_its_result_scores_low_whatever_follows() -> None:
    """The Coder models call the weather tool again after its result; scored by the second
    result (tool_ok_score) that loop would be rewarded. Same name and arguments (spacing
    aside) as a call the conversation answered: repeated_call_score."""
    oslo = [user("Weather in Oslo?"), _called(_call("c1", "Oslo")), tool("Oslo: 17 C", "c1")]
    asked = [user("Weather in Oslo?"), _called(_call("c1", "Oslo"))]  # no result yet

    async def score(messages: list[dict[str, Any]], reply: dict[str, Any], **rules: Any) -> Any:
        turn = make_turn("s", 1, messages, "")
        turn.response = reply
        judge = RulesJudge()
        if rules:
            settings = load_settings(prm={"rules": rules})
            judge = RulesJudge(judge_context("rules", settings.prm, settings.shared()))
        return await judge.score(JudgeRequest.for_turn(turn, NextState(messages=[tool("ok")])))

    again = await score(oslo, _called(_call("c2", "Oslo", spacing="  ")))
    assert again.score == -0.5 and again.hint.startswith("repeated tool call: get_weather")
    # The teacher of hindsight distillation is told what the reply should have done.
    assert (
        again.directive_hint is not None and "do not call get_weather again" in again.directive_hint
    )
    told = await score(
        oslo, _called(_call("c2", "Oslo")), repeated_call_hint="Use {name}'s result."
    )
    assert told.directive_hint == "Use get_weather's result."
    silent = await score(oslo, _called(_call("c2", "Oslo")), repeated_call_hint=None)
    assert silent.score == -0.5 and silent.directive_hint is None
    for other in (
        await score(oslo, _called(_call("c2", "Bergen"))),  # another city: a new question
        await score(asked, _called(_call("c2", "Oslo"))),  # the first call was never answered
        await score(oslo, {"role": "assistant", "content": "It is 17 C in Oslo."}),
        await score(oslo, _called(_call("c2", "Oslo")), repeated_call_score=None),  # off
    ):
        assert other.score == 0.25 and other.hint is None  # scored by the tool result after it


async def test_a_call_written_as_text_after_the_result_is_a_repeated_call() -> None:
    """Right after a tool result, the Coder models sometimes write a call the server cannot
    take (a function that is not offered, `name:`/`arguments:` lines): not an answer."""
    oslo = [user("Weather in Oslo?"), _called(_call("c1", "Oslo")), tool("Oslo: 17 C", "c1")]
    judge = RulesJudge()

    async def score(messages: list[dict[str, Any]], content: str) -> Any:
        turn = make_turn("s", 1, messages, content)
        return await judge.score(JudgeRequest.for_turn(turn, NextState(messages=[user("ok")])))

    for written, name in [
        ('{"name": "weather_in_paris", "arguments": {"city": "Oslo"}}', "get_weather"),
        ('name: get_weather\narguments: {"city": "Oslo"}', "get_weather"),
        ('get_weather({"city": "Oslo"})', "get_weather"),
    ]:
        result = await score(oslo, written)
        assert result.score == -0.5 and result.hint.startswith("a call written as text"), written
        assert result.directive_hint == ANSWER_FROM_RESULT.replace("{name}", name)
    for plain in (
        await score(oslo, "It is 17 C in Oslo."),  # an answer
        await score(
            oslo[:1], '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
        ),  # no result
    ):
        assert plain.score == 0.0 and plain.hint is None  # "ok": neutral


async def test_feedback_judge_is_decisive_only_with_feedback() -> None:
    assert await FeedbackJudge().score(request_with([user("thanks")])) is None
    result = await FeedbackJudge().score(request_with(None, fb(-0.5)))
    assert result is not None and result.decisive and result.score == -0.5


@pytest.mark.parametrize(
    ("text", "vote"),
    [
        ("GOOD", 1.0),
        ("**Bad** - the reply ignored the question", -1.0),
        ("Verdict: neutral", 0.0),
        ('{"verdict": "good", "reason": "x"}', 1.0),
        ('{"score": -0.5}', -0.5),
        ("I think this was good.", 1.0),
        ("good or bad, hard to say", None),
        ("", None),
        ("no idea", None),
    ],
)
def test_parse_vote(text: str, vote: float | None) -> None:
    assert parse_vote(text) == vote


def test_majority_and_ties() -> None:
    assert majority([1.0, 1.0, -1.0]) == (1.0, pytest.approx(1 / 3))
    assert majority([1.0, -1.0]) == (0.0, 1.0)
    assert majority([1.0, -1.0, 0.0]) == (0.0, pytest.approx(2 / 3))
    assert majority([-1.0]) == (-1.0, 0.0)


class FixedJudge(JudgeBase):
    """A judge that returns whatever it was given."""

    def __init__(self, name: str, result: Any) -> None:
        self.name = name
        self.result = result

    async def score(self, request: JudgeRequest) -> Any:
        return self.result


@pytest.mark.parametrize("bad", [1.5, -2.0, math.nan, math.inf, True, "0.5"])
async def test_invalid_judge_output_is_a_failure(bad: Any) -> None:
    metrics = PrmMetrics(CollectorRegistry())
    panel = JudgePanel([(FixedJudge("bad", JudgeResult(score=bad)), 1.0)], metrics)
    with pytest.raises(JudgeError, match="bad"):
        await panel.judge(request_with([user("hi")]))
    assert (
        metrics.registry.get_sample_value("liveloop_prm_judge_failures_total", {"judge": "bad"})
        == 1
    )
    wrong_type = JudgePanel([(FixedJudge("t", 0.5), 1.0)], metrics)
    with pytest.raises(JudgeError, match="not JudgeResult"):
        await wrong_type.judge(request_with([user("hi")]))


async def test_panel_weights_and_decisive_feedback() -> None:
    metrics = PrmMetrics(CollectorRegistry())
    panel = JudgePanel(
        [
            (FixedJudge("a", JudgeResult(score=1.0, hint="up")), 3.0),
            (FixedJudge("b", JudgeResult(score=-1.0, step_scores=[-1.0])), 1.0),
            (FixedJudge("none", None), 5.0),
        ],
        metrics,
    )
    verdict = await panel.judge(request_with([user("hi")]))
    assert verdict is not None
    assert (verdict.score, verdict.judge, verdict.step_scores) == (0.5, "a+b", [-1.0])
    with_feedback = JudgePanel([(FeedbackJudge(), 1.0), (RulesJudge(), 1.0)], metrics)
    verdict = await with_feedback.judge(request_with([user("thanks")], fb(-0.25)))
    assert verdict is not None and (verdict.score, verdict.judge) == (-0.25, "feedback")
    nobody = JudgePanel([(FixedJudge("none", None), 1.0)], metrics)
    assert await nobody.judge(request_with([user("hi")])) is None


def test_unknown_judge_lists_the_available_ones() -> None:
    settings = load_settings(prm={"judges": {"rules": 1.0, "nope": 1.0}})
    with pytest.raises(ConfigError) as err:
        load_judges(settings.prm.judges, settings.prm, settings.shared())
    message = str(err.value)
    assert "unknown judge 'nope'" in message and "\n" not in message
    assert "available judges: feedback, llm, rules" in message
    judges = load_judges({"rules": 2.0, "feedback": 1.0}, settings.prm, settings.shared())
    assert [(j.name, w) for j, w in judges] == [("rules", 2.0), ("feedback", 1.0)]


def test_judging_config_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"prm\.rules\.approval_patterns"):
        load_settings(prm={"rules": {"approval_patterns": ["(unclosed"]}})
    with pytest.raises(ConfigError, match=r"prm\.judges"):
        load_settings(prm={"judges": {"rules": 0}})
    with pytest.raises(ConfigError, match=r"prm\.judges"):
        load_settings(prm={"judges": {}})


async def test_scored_entry_keeps_the_turn_and_adds_the_verdict() -> None:
    turn = make_turn("s", 3, [user("question")], "reply", completion_tokens=5)
    raw = turn.model_dump_json()
    request = JudgeRequest(
        turn.messages, turn.response, NextState(messages=[user("thanks")]), raw=raw
    )
    verdict = await JudgePanel([(RulesJudge(), 1.0)], PrmMetrics(CollectorRegistry())).judge(
        request
    )
    assert verdict is not None
    fields = scored_fields(request, TurnHead.model_validate_json(raw), raw, verdict)
    fast = ScoredTurn.model_validate_json(fields["data"])
    slow = make_scored(turn, verdict, "next_turn")
    assert fast.model_dump(exclude={"judged_at"}) == slow.model_dump(exclude={"judged_at"})
    assert fast.completion_token_ids == turn.completion_token_ids and fast.score == 1.0
    assert (fields["session_id"], fields["turn_index"], fields["signal"]) == ("s", "3", "next_turn")
    # A record whose text mentions a verdict field takes the slow path, same result.
    tricky = make_turn("s", 3, [user('{"score": 2}')], "reply")
    raw = tricky.model_dump_json()
    request = JudgeRequest(tricky.messages, tricky.response, NextState(messages=[]), raw=raw)
    fields = scored_fields(request, TurnHead.model_validate_json(raw), raw, verdict)
    assert json.loads(fields["data"])["messages"] == tricky.messages
    assert ScoredTurn.model_validate_json(fields["data"]).score == 1.0


class WordLimit(BaseModel):
    """Settings of the plug-in judge below."""

    words: int = Field(50, ge=1)


class WordyJudge(JudgeBase):
    """A plug-in judge with settings of its own."""

    name = "wordy"
    inline = True
    settings_model = WordLimit

    def __init__(self, context: JudgeContext) -> None:
        self.limit = context.settings_as(WordLimit).words


def test_plugin_judge_settings_come_from_judge_args(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIVELOOP_PRM__JUDGE_ARGS__WORDY__WORDS", "7")
    settings = load_settings(api_keys="secret-api-key", admin_key="secret-admin-key")
    context = judge_context("wordy", settings.prm, settings.shared(), WordyJudge)
    assert WordyJudge(context).limit == 7
    assert "secret" not in repr(context)  # a factory never sees API keys or the admin key
    monkeypatch.delenv("LIVELOOP_PRM__JUDGE_ARGS__WORDY__WORDS")
    toml = tmp_path / "judges.toml"
    toml.write_text("[prm.judge_args.wordy]\nwords = 12\n")
    settings = load_settings(toml)
    context = judge_context("wordy", settings.prm, settings.shared(), WordyJudge)
    assert WordyJudge(context).limit == 12
    toml.write_text("[prm.judge_args.wordy]\nwords = 0\n")
    with pytest.raises(ConfigError, match=r"prm\.judge_args\.wordy\.words"):
        judge_context("wordy", load_settings(toml).prm, settings.shared(), WordyJudge)
    toml.write_text("[prm.judge_args.feedback]\nwords = 3\n")
    with pytest.raises(ConfigError, match="judge 'feedback' takes no settings"):
        judge_context("feedback", load_settings(toml).prm, settings.shared())
    with pytest.raises(ConfigError, match=r"configured in \[prm\.rules\]"):
        load_settings(prm={"judge_args": {"rules": {"timeout_score": 0.5}}})


def test_judge_protocol_includes_inline_and_aclose() -> None:
    class Bare:
        name = "bare"

        async def score(self, request: JudgeRequest) -> JudgeResult | None:
            return None

    assert not isinstance(Bare(), Judge)  # inline and aclose are part of the protocol
    assert isinstance(WordyJudge(JudgeContext("wordy")), Judge)
    assert isinstance(RulesJudge(), Judge) and RulesJudge().inline

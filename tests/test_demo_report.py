"""The demo report's learning curves and its objective and hint sections, on known turns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from liveloop.config import load_settings
from liveloop.demo.curves import (
    gain_standard_error,
    moving_mean,
    turns_to_threshold,
    window_means,
)
from liveloop.demo.measures import tool_use_by_version, user_reactions
from liveloop.demo.report import (
    JudgedTurn,
    headline,
    summarise,
    training_figures,
    write_report,
)
from liveloop.demo.run import demo_objectives, objective_figures
from liveloop.demo.users import ToolAsk, TurnLog
from tests.test_demo_pacing import demo_settings


def test_curves_by_hand() -> None:
    scores = [-1.0, -1.0, 0.0, 1.0, 1.0, 1.0, -1.0]
    assert window_means(scores, 2) == [-1.0, 0.5, 1.0, -1.0]
    assert window_means(scores, 4) == [-0.25, 1 / 3]
    assert moving_mean(scores, 2) == [-1.0, -1.0, -0.5, 0.5, 1.0, 1.0, 0.0]
    assert turns_to_threshold(scores, 0.5, 2) == 4
    assert turns_to_threshold(scores, 1.0, 3) == 6
    assert turns_to_threshold(scores, -1.0, 3) == 3  # only full windows count
    assert turns_to_threshold(scores, 1.5, 2) is None
    # Variances 2 (of -1, 1) and 1 (of 1, 1, 1, -1): 2 / 2 + 1 / 4.
    assert gain_standard_error([-1.0, 1.0], [1.0, 1.0, 1.0, -1.0]) == pytest.approx(1.25**0.5)
    assert gain_standard_error([1.0, 1.0], [0.0, 0.0, 0.0]) == 0.0
    assert gain_standard_error([1.0], [0.0, 1.0]) is None  # one score has no spread to measure


def turns(scores: list[float], hinted_every: int = 3) -> list[JudgedTurn]:
    out = []
    for i, score in enumerate(scores):
        hint = "Shorter, please: 8 words at most." if i % hinted_every == 0 else None
        out.append(
            JudgedTurn(
                score=score,
                version=i // 10,
                tokens=16,
                words=9,
                judged_at=1000.0 + i,
                turn_type="main",
                question="Tell me about bees.",
                reply="Bees make honey and live in hives all year.",
                hint=hint,
                messages=[{"role": "user", "content": "Tell me about bees."}] if hint else None,
            )
        )
    return out


def test_training_figures_average_the_updates_that_taught() -> None:
    updates = [
        {"seconds": 2.0, "hint_share": 0.5, "opd_samples": 4, "opd_advantage": -0.2,
         "opd_seconds": 0.5, "opd_gap_before": 0.4, "opd_gap_after": 0.3},
        {"seconds": 4.0, "hint_share": 0.0, "opd_samples": 0, "opd_advantage": 0.0,
         "opd_seconds": 0.0, "opd_skipped_too_long": 2.0},
        {},  # an announcement without statistics (a restart's re-announcement)
    ]  # fmt: skip
    figures = training_figures(updates)
    assert figures["updates"] == 2 and figures["updates_with_opd"] == 1
    assert figures["seconds"] == 3.0 and figures["opd_seconds"] == 0.25
    assert (figures["opd_gap_before"], figures["opd_gap_after"]) == (0.4, 0.3)
    assert figures["opd_skipped"] == {"too_long": 2.0}


def test_report_compares_objectives_and_shows_hints(tmp_path: Path) -> None:
    slow = [-1.0] * 40 + [0.0] * 20 + [1.0] * 20
    fast = [-1.0] * 20 + [1.0] * 60
    runs = {"rl": turns(slow), "combine": turns(fast)}
    summaries = {name: summarise(ts, 16, threshold=0.5) for name, ts in runs.items()}
    for name, summary in summaries.items():
        summary.update(objective=name, training=training_figures([]))
    summary = summaries["combine"]
    summary["hint_examples"] = [
        {"hint": "Shorter, please: 8 words at most.", "question": "Tell me about bees.",
         "version_before": 0, "before": "A long reply " * 5, "version_after": 7,
         "after": "Bees make honey."},
    ]  # fmt: skip
    summary["objectives"] = {name: objective_figures(s) for name, s in summaries.items()}
    curves = {name: [t.score for t in ts] for name, ts in runs.items()}
    paths = write_report(tmp_path, summary, runs["combine"], curves)
    report = json.loads(paths["json"].read_text())
    compared = report["objectives"]
    # a 16-turn window averages 0.5 once it holds 12 +1s and 4 -1s (or 8 +1s and 8 0s)
    assert compared["combine"]["turns_to_threshold"] == 32
    assert compared["rl"]["turns_to_threshold"] == 68
    assert compared["combine"]["hint_share"] == pytest.approx(27 / 80)
    assert compared["rl"]["reward_per_window"] == [-1.0, -1.0, -0.5, 0.25, 1.0]
    markdown = paths["md"].read_text()
    assert "## Objectives compared" in markdown and "| combine | 80 |" in markdown
    assert "## Directive hints" in markdown and "34% of judged turns" in markdown
    assert "| Shorter, please: 8 words at most. | Tell me about bees. | v0:" in markdown
    assert paths["png"].stat().st_size > 10_000


def test_demo_objectives_default_per_model_and_asked_ones_win() -> None:
    """smollm2 learns from the reward alone unless told (its hinted teacher hurt it)."""
    assert demo_objectives(demo_settings("--model", "tiny-random")) == ["combine"]
    assert demo_objectives(demo_settings("--model", "smollm2-135m")) == ["rl"]
    asked = demo_settings("--model", "smollm2-135m", "--objective", "combine,rl,combine")
    assert demo_objectives(asked) == ["combine", "rl"]
    with pytest.raises(ValueError):
        load_settings(model="smollm2-135m", demo={"objectives": []})


def answer(at: float, reason: str, weather: bool = False, used_tool: bool = False) -> TurnLog:
    rating = {"pleased": 1.0, "nearly": 0.0}.get(reason, -1.0)
    return TurnLog(
        user=0, preference="weather_tool" if weather else "word_limit", words=12, tokens=20,
        rating=rating, version=0, at=at, reason=reason, tool_offered=weather,
        used_tool=used_tool,
    )  # fmt: skip


def test_report_says_why_users_were_unhappy_early_and_late(tmp_path: Path) -> None:
    """The users' own reasons, first and last window, and whether the weather tool was used."""
    early = ["too_long"] * 5 + ["off_topic"] * 2 + ["pleased"]
    late = ["pleased"] * 5 + ["nearly", "too_long"]
    answers = [answer(float(i), r) for i, r in enumerate(early + late)]
    answers.append(answer(100.0, "no_tool", weather=True))
    answers.insert(0, answer(200.0, "pleased", weather=True, used_tool=True))  # order: by time
    asks = [ToolAsk(0, called=False), ToolAsk(0, called=True), ToolAsk(0, called=True)]
    asks.append(ToolAsk(0, called=True, after_result=True))  # a re-call: not a question
    said = user_reactions(answers, window=8, asks=asks)
    assert said["window"] == 8
    assert said["first"] == {"too_long": 5 / 8, "off_topic": 2 / 8, "pleased": 1 / 8}
    assert said["last"] == {
        "pleased": 5 / 8, "nearly": 1 / 8, "too_long": 1 / 8, "no_tool": 1 / 8
    }  # fmt: skip
    assert (said["weather_answers"], said["answers_after_tool"]) == (2, 1)
    assert (said["weather_questions"], said["questions_called"]) == (3, 2)  # one never answered
    assert user_reactions(answers[:3], window=8, asks=[])["window"] == 1  # at most half
    summary = summarise(turns([-1.0] * 10 + [1.0] * 10), 8)
    assert (summary["improvement"], summary["improvement_se"]) == (2.0, 0.0)  # no spread
    summary.update(objective="rl", training=training_figures([]), reactions=said)
    markdown = write_report(tmp_path, summary, turns([0.0] * 20))["md"].read_text()
    assert "## What the users said" in markdown
    assert "| too long | 62% | 12% |" in markdown
    assert "| wanted the weather tool used | 0% | 12% |" in markdown
    assert (
        "Weather questions: 3, of which 2 got a call to the weather tool as their first "
        "reply; 2 answered, 1 of the answers after a call." in markdown
    )
    assert "| v0 | 3 | 67% | 1 | 100% | 2 | 50% | 0% |" in markdown  # its answer names no result


def test_the_headline_drift_is_that_of_the_weights_served_last() -> None:
    """After a rollback the final version is a copy of an earlier one, and has no probe:
    the headline's reference NLL is the copied version's, not a refused or rolled-back one's."""
    platform = {
        "0": {"probe": {"ref_nll": 2.8}, "status": "base"},
        "12": {"probe": {"ref_nll": 2.9}, "status": "accepted"},
        "13": {"probe": {"ref_nll": 4.0}, "status": "rolled_back"},
        "14": {"probe": {"ref_nll": 5.0}, "status": "rejected"},
        "15": {"status": "accepted"},  # v12's weights again
    }
    out = headline({"improvement": 0.2, "platform": platform})
    assert out["final_probed_version"] == 12
    assert out["ref_nll_ratio"] == pytest.approx(2.9 / 2.8)
    assert out["quality_kept"]["ref_nll"] is True


def test_tool_use_per_version_counts_calls_answers_and_answers_that_used_the_result() -> None:
    def weather(version: int, reply: str, result: str | None) -> TurnLog:
        return TurnLog(user=0, preference="weather_tool", words=3, tokens=5, rating=0.0,
                       version=version, at=float(version), question="Weather in Oslo?",
                       reply=reply, tool_offered=True, used_tool=result is not None,
                       tool_result=result or "")  # fmt: skip

    oslo = "Oslo: snow, -3 C"
    answers = [
        weather(0, "It is sunny.", None),  # no call
        weather(0, "Sunny in Oslo.", None),
        weather(3, "Snow in Oslo today.", oslo),  # called, used the result
        weather(3, "It is sunny in Oslo.", oslo),  # called, then made the weather up
        weather(4, "Oslo has snow.", oslo),
        TurnLog(user=1, preference="limit", words=3, tokens=4, rating=1.0, version=4, at=9.0),
    ]
    # first replies: v0 answered twice without a call; v3 called three times (one question
    # never got an answer: the model called again after each result, twice on v3 and once
    # on v4, which answered the other questions after their results); v5 called, no answer
    asks = [ToolAsk(0, False), ToolAsk(0, False), *[ToolAsk(3, True)] * 3, ToolAsk(5, True)]
    asks += [*[ToolAsk(3, True, after_result=True)] * 2, ToolAsk(4, True, after_result=True)]
    asks += [ToolAsk(4, False, after_result=True)] * 3
    by_version = tool_use_by_version(answers, asks)
    row = ("questions", "tool_call_rate", "after_result", "recall_rate", "answers",
           "answered_after_call_rate", "used_result_rate")  # fmt: skip
    assert {v: tuple(r[k] for k in row) for v, r in by_version.items()} == {
        "0": (2, 0.0, 0, None, 2, 0.0, None),
        "3": (3, 1.0, 2, 1.0, 2, 1.0, 0.5),
        "4": (0, None, 4, 0.25, 1, 1.0, 1.0),  # answered after v3's call: the answer is v4's
        "5": (1, 1.0, 0, None, 0, None, None),
    }
    assert user_reactions(answers, 2, asks)["tool_use"] == by_version
    # A call written as text after the result is a re-call, and no use of the result.
    written = '{"name": "weather_in_paris", "arguments": {"weather": "snow"}}'
    later = tool_use_by_version(
        [weather(6, written, oslo)], [ToolAsk(6, False, after_result=True, written=True)]
    )["6"]
    assert (later["recall_rate"], later["written_calls"], later["used_result_rate"]) == (
        1.0,
        1,
        0.0,
    )

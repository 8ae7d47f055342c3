"""The LLM judge's directive hints, against a real OpenAI-compatible server: `liveloop serve`
on tiny-random, with a scripted judge prompt.

A randomly initialised model writes no sensible verdicts, so the script is in the judge's
configuration: structured output (`output = "json"`) with a vote schema whose verdict and
hints are enumerated. The server's constrained decoding then makes every vote a valid JSON
object holding one of the scripted hints, chosen by sampling; the judge must parse each vote
through the real HTTP layer and keep the longest non-trivial hint among them.
"""

from __future__ import annotations

from typing import Any

import redis

from liveloop.config import load_settings
from liveloop.prm.judges import JudgeRequest, NextState, judge_context
from liveloop.prm.judges.llm import LLMJudge
from tests.server_proc import API_KEYS
from tests.synthetic import make_turn, user

pytest_plugins = ["tests.server_fixtures"]

HINTS = [
    "",
    "Be brief.",  # 9 characters: a trivial hint, never kept
    "Answer in at most eight words.",
    "Name the topic in your first three words, then stop.",
]
SCRIPT = {
    "type": "object",
    "properties": {
        "verdict": {"type": "string", "enum": ["BAD"]},
        "hint": {"type": "string", "enum": HINTS},
    },
    "required": ["verdict", "hint"],
    "additionalProperties": False,
}


def judge_for(server_url: str) -> LLMJudge:
    settings = load_settings(
        model="tiny-random",
        prm={
            "llm": {
                "base_url": server_url + "/v1",
                "api_key": API_KEYS[0],
                "votes": 3,
                "max_tokens": 48,
                "temperature": 1.0,
                "output": "json",
                "json_schema": SCRIPT,
                "system_prompt": "Reply with the JSON vote the schema allows.",
            }
        },
    )
    return LLMJudge(judge_context("llm", settings.prm, settings.shared()))


def request(i: int) -> JudgeRequest:
    turn = make_turn(f"llm-hint-{i}", 0, [user(f"Tell me about topic {i}.")], "A long reply " * 9)
    return JudgeRequest.for_turn(turn, NextState(messages=[user("Too long, please be brief.")]))


async def test_llm_judge_keeps_the_longest_hint_among_its_votes(
    server_url: str, server_redis: redis.Redis
) -> None:
    judge = judge_for(server_url)
    recorded_before = int(server_redis.xlen("liveloop:turns"))  # type: ignore[arg-type]
    kept: list[str] = []
    try:
        for i in range(6):
            result = await judge.score(request(i))
            assert result is not None and result.votes == [-1.0, -1.0, -1.0]
            vote_hints: list[Any] = result.extra["vote_hints"]
            assert len(vote_hints) == 3 and all(h is None or h in HINTS for h in vote_hints)
            candidates = [h for h in vote_hints if h and len(h) >= 10]
            assert result.directive_hint == max(candidates, key=len, default=None)
            if result.directive_hint:
                kept.append(result.directive_hint)
    finally:
        await judge.aclose()
    assert kept, "no vote over six turns carried a non-trivial hint"
    # The judge's own requests are never recorded as training traffic.
    assert int(server_redis.xlen("liveloop:turns")) == recorded_before  # type: ignore[arg-type]

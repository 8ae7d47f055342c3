"""The `llm` judge against a stand-in judge endpoint: a real OpenAI-compatible HTTP server.

The stand-in (FastAPI + uvicorn in a thread) answers /v1/chat/completions with scripted
votes: the script is named in the conversation's next state, and vote i of a turn gets the
script's entry i (the judge sends `seed=i`). It records every request's headers and body
and how many requests were in flight at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as aredis
import uvicorn
from fastapi import FastAPI, Request

from liveloop.config import LiveLoopSettings, load_settings
from liveloop.contracts import ScoredTurn
from liveloop.prm.judges import (
    JudgeContext,
    JudgeError,
    JudgeRequest,
    NextState,
    judge_context,
    load_judge,
)
from liveloop.prm.judges.llm import LLMJudge
from liveloop.valkey import free_port
from tests.synthetic import conversation, make_turn, user, write_turns
from tests.test_prm_loop import count_is, judging, scored, wait_for

SCRIPTS: dict[str, list[str]] = {
    "good": ["GOOD", "Verdict: good", '{"verdict": "good"}'],
    "split": ["GOOD", "BAD", "I cannot tell."],  # one malformed, then a 1-1 tie
    "garbage": ["hmm", "", "good or bad, who knows"],
    "bad": ["BAD", "bad", "GOOD"],
}


class StandInJudgeEndpoint:
    """A scripted OpenAI-compatible chat endpoint on a free port."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.delay_s = 0.0
        self.port = free_port()
        app = FastAPI()
        app.post("/v1/chat/completions")(self._complete)
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def _complete(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        self.requests.append({"headers": dict(request.headers), "body": body})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        next_state = body["messages"][-1]["content"].split("## What happened next")[-1]
        name = next((n for n in SCRIPTS if f"SCRIPT:{n}" in next_state), "good")
        content = SCRIPTS[name][int(body.get("seed") or 0) % len(SCRIPTS[name])]
        return {
            "id": "chatcmpl-standin",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    def __enter__(self) -> StandInJudgeEndpoint:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "stand-in endpoint did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def endpoint() -> Iterator[StandInJudgeEndpoint]:
    with StandInJudgeEndpoint() as server:
        yield server


def llm_settings(endpoint: StandInJudgeEndpoint, **llm: Any) -> LiveLoopSettings:
    # No base_url: the judge defaults to "this LiveLoop server", here the stand-in's port.
    return load_settings(model="judge-model", port=endpoint.port, prm={"llm": llm})


def llm_context(settings: LiveLoopSettings) -> JudgeContext:
    """What the `llm` judge's factory receives under these settings."""
    return judge_context("llm", settings.prm, settings.shared())


def request_for(script: str, reply: str = "Paris is the capital.") -> JudgeRequest:
    turn = make_turn("s", 0, [user("What is the capital of France?")], reply)
    state = NextState(messages=[user(f"SCRIPT:{script} ok, next question")])
    return JudgeRequest.for_turn(turn, state)


async def test_votes_majority_ties_and_malformed_votes(endpoint: StandInJudgeEndpoint) -> None:
    settings = llm_settings(endpoint)
    judge = load_judge("llm", settings.prm, settings.shared())
    assert isinstance(judge, LLMJudge)
    try:
        good = await judge.score(request_for("good"))
        assert good is not None and (good.score, good.votes) == (1.0, [1.0, 1.0, 1.0])
        split = await judge.score(request_for("split"))
        assert split is not None and (split.score, split.votes) == (0.0, [1.0, -1.0])
        assert split.extra["disagreement"] == 1.0
        bad = await judge.score(request_for("bad"))
        assert bad is not None and bad.score == -1.0
        with pytest.raises(JudgeError, match="no valid vote"):
            await judge.score(request_for("garbage"))
    finally:
        await judge.aclose()
    first = endpoint.requests[0]
    assert first["headers"]["x-liveloop-train"] == "false"  # never recorded as training data
    assert first["body"]["model"] == "judge-model"
    prompt = first["body"]["messages"][-1]["content"]
    for shown in ("What is the capital of France?", "Paris is the capital.", "SCRIPT:good ok"):
        assert shown in prompt
    assert {r["body"]["seed"] for r in endpoint.requests[:3]} == {0, 1, 2}


async def test_concurrency_limit_and_timeouts(endpoint: StandInJudgeEndpoint) -> None:
    endpoint.delay_s = 0.15
    judge = LLMJudge(llm_context(llm_settings(endpoint, concurrency=2)))
    try:
        results = await asyncio.gather(*(judge.score(request_for("good")) for _ in range(3)))
        assert all(r is not None and r.score == 1.0 for r in results)
        assert endpoint.max_in_flight == 2
        endpoint.delay_s = 1.0
        slow = LLMJudge(llm_context(llm_settings(endpoint, timeout_s=0.2)))
        with pytest.raises(JudgeError, match="timeout"):
            await slow.score(request_for("good"))
        await slow.aclose()
    finally:
        await judge.aclose()
    unreachable = LLMJudge(
        llm_context(load_settings(prm={"llm": {"base_url": f"http://127.0.0.1:{free_port()}/v1"}}))
    )
    with pytest.raises(JudgeError, match="no valid vote"):
        await unreachable.score(request_for("good"))
    await unreachable.aclose()


async def test_llm_judge_in_the_loop_writes_votes(
    endpoint: StandInJudgeEndpoint, aredis_client: aredis.Redis, redis_url: str
) -> None:
    settings = load_settings(
        redis_url=redis_url,
        model="judge-model",
        port=endpoint.port,
        prm={
            "judges": {"llm": 1.0},
            "next_state_timeout_s": 30,
            "consumer": {"claim_idle_ms": 100},
        },
    )
    turns = conversation("s", [user("hi"), user("SCRIPT:split hm"), user("SCRIPT:bad no")])
    async with judging(aredis_client, settings) as service:
        await write_turns(aredis_client, turns)
        await wait_for(lambda: count_is(aredis_client, "liveloop:scored", 2))
    got: dict[str, ScoredTurn] = {s.key: s for s in await scored(aredis_client)}
    assert (got["s:0:0"].score, got["s:0:0"].votes, got["s:0:0"].judge) == (0.0, [1.0, -1.0], "llm")
    assert (got["s:1:0"].score, got["s:1:0"].votes) == (-1.0, [-1.0, -1.0, 1.0])
    disagreement = service.metrics.registry.get_sample_value(
        "liveloop_prm_votes_disagreement_count", {"judge": "llm"}
    )
    assert disagreement == 2

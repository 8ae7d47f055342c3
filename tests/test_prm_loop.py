"""The judging loop in-process against a real Valkey: pairing, feedback, timeouts, failures."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from liveloop import bus
from liveloop.bus import StreamConsumer, keys
from liveloop.config import LiveLoopSettings, load_settings
from liveloop.contracts import Feedback, ScoredTurn, group_key
from liveloop.prm.judges import (
    Judge,
    JudgeBase,
    JudgeRequest,
    JudgeResult,
    load_judges,
    message_text,
)
from liveloop.prm.metrics import PrmMetrics
from liveloop.prm.panel import JudgePanel
from liveloop.prm.service import JudgeService
from tests.conftest import wait_for
from tests.synthetic import conversation, make_turn, tool, user, write_turns


def fast_settings(redis_url: str, **prm: Any) -> LiveLoopSettings:
    base: dict[str, Any] = {
        "next_state_timeout_s": 0.6,
        "consumer": {"claim_idle_ms": 100},
        "sweep_interval_s": 0.05,
    }
    base["rules"] = {"timeout_score": 0.0}  # score silence as neutral, to see timeouts scored
    base.update(prm)
    return load_settings(redis_url=redis_url, prm=base)


@asynccontextmanager
async def judging(
    client: aredis.Redis,
    settings: LiveLoopSettings,
    judges: list[tuple[Judge, float]] | None = None,
) -> AsyncIterator[JudgeService]:
    metrics = PrmMetrics(CollectorRegistry())
    panel = JudgePanel(
        judges or load_judges(settings.prm.judges, settings.prm, settings.shared()),
        metrics,
        timeout_s=settings.prm.judge_timeout_s,
    )
    service = JudgeService(client, settings.prm, panel, metrics, consumer_name="test")
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        yield service
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def scored(client: aredis.Redis, stream: str = bus.SCORED) -> list[ScoredTurn]:
    return [bus.decode(f, ScoredTurn) for _id, f in await client.xrange(bus.stream_key(stream))]


async def count_is(client: aredis.Redis, key: str, n: int) -> bool:
    return int(await client.xlen(key)) >= n


async def key_exists(client: aredis.Redis, key: str) -> bool:
    return bool(await client.exists(key))


def metric(service: JudgeService, name: str, **labels: str) -> float:
    return service.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_pairs_next_turn_feedback_timeout_and_skips_side_turns(
    aredis_client: aredis.Redis, redis_url: str
) -> None:
    a = conversation(
        "a", [user("hi"), user("thanks, perfect"), [tool("Traceback (most recent call last):")]]
    )
    side = make_turn("a", 9, [user("title for this chat?")], "Greetings", turn_type="side")
    b = conversation("b", [user("hello")])
    early = Feedback(session_id="c", turn_index=0, score=-0.75, tenant="t", comment="bad")
    async with judging(aredis_client, fast_settings(redis_url)) as service:
        await bus.publish(aredis_client, bus.FEEDBACK, early)  # before its turn exists
        await write_turns(aredis_client, [*a, side, *b])
        # The turn and feedback streams are read by separate loops: let b's turn be taken
        # in first, so that its feedback pairs at once instead of being stored.
        b_waiting = keys.waiting_group(group_key("b", 0))
        await wait_for(lambda: key_exists(aredis_client, b_waiting))
        await bus.publish(
            aredis_client,
            bus.FEEDBACK,
            Feedback(session_id="b", turn_index=0, score=0.5, tenant="t"),
        )
        # c's feedback (published first) must be stored before c's turn arrives.
        c_feedback = keys.early_feedback_key(group_key("c", 0))
        await wait_for(lambda: key_exists(aredis_client, c_feedback))
        await write_turns(aredis_client, conversation("c", [user("question")]))
        await wait_for(lambda: count_is(aredis_client, "liveloop:scored", 5))
        await asyncio.sleep(0.3)  # nothing more may arrive
    got = {s.key: s for s in await scored(aredis_client)}
    assert sorted(got) == ["a:0:0", "a:1:0", "a:2:0", "b:0:0", "c:0:0"]
    assert (got["a:0:0"].score, got["a:0:0"].signal, got["a:0:0"].judge) == (
        1.0,
        "next_turn",
        "rules",
    )
    assert (got["a:1:0"].score, got["a:1:0"].signal) == (-1.0, "next_turn")
    assert "tool error" in (got["a:1:0"].hint or "")
    assert (got["a:2:0"].score, got["a:2:0"].signal) == (0.0, "timeout")  # last turn of a
    assert (got["b:0:0"].score, got["b:0:0"].signal, got["b:0:0"].judge) == (
        0.5,
        "feedback",
        "feedback",
    )
    assert (got["c:0:0"].score, got["c:0:0"].hint) == (-0.75, "bad")
    # The scored entry carries the turn's token data for the collector.
    assert got["a:0:0"].completion_token_ids == a[0].completion_token_ids
    assert got["a:0:0"].logprobs == a[0].logprobs and got["a:0:0"].messages == a[0].messages
    assert metric(service, "liveloop_prm_turns_total", outcome="side") == 1
    assert metric(service, "liveloop_prm_scored_total", signal="timeout") == 1
    assert metric(service, "liveloop_prm_scored_total", signal="feedback") == 2
    assert metric(service, "liveloop_prm_feedback_total", outcome="stored") == 1
    assert metric(service, "liveloop_prm_judge_latency_seconds_count", judge="rules") >= 5
    # Everything was acknowledged and the pairing state is gone.
    assert await aredis_client.keys("liveloop:prm:w:*") == []
    assert await aredis_client.zcard("liveloop:prm:deadlines") == 0
    assert await aredis_client.xpending("liveloop:turns", "prm") == {
        "pending": 0,
        "min": None,
        "max": None,
        "consumers": [],
    }


async def test_successor_before_turn_and_redelivery_score_once(
    aredis_client: aredis.Redis, redis_url: str
) -> None:
    turns = conversation("s", [user("one"), user("no, that's wrong"), user("thanks")])
    async with judging(aredis_client, fast_settings(redis_url, next_state_timeout_s=30)):
        # Turn 1 is stored before turn 0 (two judge processes racing), and turn 1 is written
        # twice (a producer retry): still each turn is paired with its successor, once.
        await write_turns(aredis_client, [turns[1]])
        await wait_for(lambda: key_exists(aredis_client, keys.waiting_key(turns[1].key)))
        await write_turns(aredis_client, [turns[0], turns[1], turns[2]])
        await wait_for(lambda: count_is(aredis_client, "liveloop:scored", 2))
        await asyncio.sleep(0.3)
    got = {s.key: (s.score, s.signal) for s in await scored(aredis_client)}
    assert got == {"s:0:0": (-1.0, "next_turn"), "s:1:0": (1.0, "next_turn")}


class FlakyJudge(JudgeBase):
    """Raises on replies saying 'boom', hangs on 'hang', else scores +1."""

    name = "flaky"

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    async def score(self, request: JudgeRequest) -> JudgeResult | None:
        text = message_text(request.response)
        self.calls[text] = self.calls.get(text, 0) + 1
        if "boom" in text:
            raise RuntimeError("boom")
        if "hang" in text:
            await asyncio.sleep(3600)
        return JudgeResult(score=1.0)


async def test_failing_judge_retries_then_dead_letters_without_stalling(
    aredis_client: aredis.Redis, redis_url: str
) -> None:
    settings = fast_settings(redis_url, max_attempts=3, judge_timeout_s=0.3)
    judge = FlakyJudge()
    bad = [
        make_turn("x", 0, [user("q")], "boom"),
        make_turn("y", 0, [user("q")], "hang"),
    ]
    good = [make_turn(f"ok{i}", 0, [user("q")], f"fine {i}") for i in range(5)]
    async with judging(aredis_client, settings, [(judge, 1.0)]) as service:
        await write_turns(aredis_client, [*bad, *good])
        await wait_for(lambda: count_is(aredis_client, "liveloop:turns:dlq", 2))
        await wait_for(lambda: count_is(aredis_client, "liveloop:scored", 5))
    dead = await aredis_client.xrange("liveloop:turns:dlq")
    errors = {json.loads(f["data"])["session_id"]: f for _id, f in dead}
    assert "raised RuntimeError: boom" in errors["x"]["error"]
    assert "timed out" in errors["y"]["error"]
    assert errors["x"]["attempts"] == "3" and errors["x"]["turn_key"] == "x:0:0"
    assert judge.calls["boom"] == 3 and judge.calls["hang"] == 3
    # The good turns were scored long before the bad ones gave up.
    scored_entries = await aredis_client.xrange("liveloop:scored")
    assert sorted(bus.decode(f, ScoredTurn).session_id for _i, f in scored_entries) == [
        f"ok{i}" for i in range(5)
    ]
    last_scored = max(int(i.split("-")[0]) for i, _f in scored_entries)
    first_dead = min(int(i.split("-")[0]) for i, _f in dead)
    assert last_scored < first_dead
    assert metric(service, "liveloop_prm_dead_letters_total", stream="liveloop:turns:dlq") == 2
    assert metric(service, "liveloop_prm_judge_failures_total", judge="flaky") == 6
    assert await aredis_client.keys("liveloop:prm:w:*") == []  # dead turns are not retried later


async def test_malformed_records_dead_letter_at_once(
    aredis_client: aredis.Redis, redis_url: str
) -> None:
    good = make_turn("g", 0, [user("q")], "a")
    await aredis_client.xadd("liveloop:turns", {"data": "{not json"})
    await aredis_client.xadd("liveloop:turns", {"data": json.dumps({"session_id": "x"})})
    await aredis_client.xadd("liveloop:feedback", {"data": json.dumps({"score": 7})})
    await write_turns(aredis_client, [good])
    async with judging(aredis_client, fast_settings(redis_url, next_state_timeout_s=0.2)):
        await wait_for(lambda: count_is(aredis_client, "liveloop:scored", 1))
    dead = [f for _i, f in await aredis_client.xrange("liveloop:turns:dlq")]
    assert len(dead) == 2 and all(f["error"].startswith("malformed turn record") for f in dead)
    assert dead[0]["data"] == "{not json" and dead[0]["attempts"] == "1"
    fb_dead = await aredis_client.xrange("liveloop:feedback:dlq")
    assert len(fb_dead) == 1 and "malformed feedback" in fb_dead[0][1]["error"]


def test_retry_delay_doubles_up_to_the_cap(aredis_client: aredis.Redis) -> None:
    consumer = StreamConsumer(aredis_client, "turns", "g", claim_idle_ms=500, backoff_max_s=3.0)
    assert [consumer.retry_delay_s(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


class SlowJudge(JudgeBase):
    """Takes longer than the claim time on every turn and counts its calls."""

    name = "slow"

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    async def score(self, request: JudgeRequest) -> JudgeResult | None:
        text = message_text(request.response)
        self.calls[text] = self.calls.get(text, 0) + 1
        await asyncio.sleep(1.2)
        return JudgeResult(score=0.5)


async def test_slow_judge_work_is_not_stolen_by_another_consumer(
    aredis_client: aredis.Redis, redis_url: str
) -> None:
    # Keep-alive runs every claim_idle_ms / 3: 300 ms leaves a loaded machine 200 ms of slack.
    settings = fast_settings(
        redis_url, next_state_timeout_s=0.1, slow_read_count=2, consumer={"claim_idle_ms": 300}
    )
    judge = SlowJudge()
    turns = [make_turn(f"s{i}", 0, [user("q")], f"reply {i}") for i in range(6)]
    metrics = PrmMetrics(CollectorRegistry())
    panel = JudgePanel([(judge, 1.0)], metrics)
    services = [
        JudgeService(aredis_client, settings.prm, panel, metrics, consumer_name=name)
        for name in ("a", "b")
    ]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(s.run(stop)) for s in services]
    await write_turns(aredis_client, turns)
    await wait_for(lambda: count_is(aredis_client, "liveloop:scored", 6))
    await asyncio.sleep(0.3)
    stop.set()
    await asyncio.gather(*tasks)
    # claim_idle_ms is 300 ms and each turn takes 1200 ms, yet the consumer judging a turn
    # keeps it: every turn is judged once, by one of the two consumers.
    assert judge.calls == {f"reply {i}": 1 for i in range(6)}
    assert await aredis_client.xlen("liveloop:scored") == 6


async def test_no_opinion_after_timeout_leaves_the_turn_unscored_and_counted(
    aredis_client: aredis.Redis, redis_url: str
) -> None:
    settings = fast_settings(
        redis_url, next_state_timeout_s=0.2, judges={"rules": 1.0}, rules={"timeout_score": None}
    )
    turns = conversation("u", [user("q"), user("thanks")])
    async with judging(aredis_client, settings) as service:
        await write_turns(aredis_client, turns)
        await wait_for(lambda: count_is(aredis_client, "liveloop:scored", 1))

        async def unscored() -> bool:
            return metric(service, "liveloop_prm_turns_total", outcome="unscored") == 1

        await wait_for(unscored)
    assert [s.key for s in await scored(aredis_client)] == ["u:0:0"]
    assert await aredis_client.keys("liveloop:prm:w:*") == []


async def _consumed(client: aredis.Redis, n: int) -> bool:
    """The judging loop has read and acknowledged the first n turns-stream entries."""
    for group in await client.xinfo_groups(bus.stream_key(bus.TURNS)):
        if group["name"] == "prm":
            return int(group.get("entries-read") or 0) >= n and int(group["pending"]) == 0
    return False


def _with_side_turns(session: str, sides: int, reply: str) -> list[Any]:
    """Main turn 0, `sides` side turns, then main turn 1 + sides answering turn 0."""
    first = conversation(session, [user("hello")])[0]
    history = [*first.messages, first.response, user(reply)]
    middle = [
        make_turn(session, 1 + j, [user("a title for this chat?")], "Chat", turn_type="side")
        for j in range(sides)
    ]
    return [first, *middle, make_turn(session, 1 + sides, history, "ok")]


async def test_side_turns_between_main_turns_do_not_break_pairing(
    aredis_client: aredis.Redis, redis_url: str
) -> None:
    """A side turn between two main turns: the earlier main turn still pairs with the later
    one (not a timeout), whether the side turns arrive before or after the later main turn."""
    in_order = _with_side_turns("a", 1, "thanks, perfect")
    reversed_ = _with_side_turns("b", 2, "no, that's wrong")[::-1]  # main 3, side 2, side 1, main 0
    async with judging(aredis_client, fast_settings(redis_url, next_state_timeout_s=30)) as svc:
        await write_turns(aredis_client, in_order)
        written = len(in_order)
        for turn in reversed_:  # one at a time, each taken in before the next is written
            await wait_for(lambda n=written: _consumed(aredis_client, n))  # type: ignore[misc]
            await write_turns(aredis_client, [turn])
            written += 1
        await wait_for(lambda: count_is(aredis_client, "liveloop:scored", 2))
        await wait_for(lambda: _consumed(aredis_client, written))
    got = {s.key: (s.score, s.signal) for s in await scored(aredis_client)}
    assert got == {"a:0:0": (1.0, "next_turn"), "b:0:0": (-1.0, "next_turn")}
    assert metric(svc, "liveloop_prm_turns_total", outcome="side") == 3
    assert await aredis_client.zcard("liveloop:prm:deadlines") == 2  # a:2 and b:3 wait on

"""A tool call is credited with the judgment of the answer it led to (`CallCredit`), alone and
through a real collector on Valkey."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aredis

from liveloop import bus
from liveloop.collector.advantages import PendingSample
from liveloop.collector.call_credit import CallCredit, answered_ids, call_ids
from liveloop.collector.loop import Collector
from liveloop.contracts import ScoredTurn, TrainingBatch
from tests.conftest import wait_for
from tests.test_collector_support import publish_turns, scored_turn, settings_for

FAST = {"group_wait_s": 0.0, "min_turns": 1, "max_wait_s": 0.05, "max_queued_batches": None}
QUESTION = {"role": "user", "content": "Weather in Oslo?"}


def _call(call_id: str) -> dict[str, Any]:
    fn = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    return {"id": call_id, "type": "function", "function": fn}


def call_turn(session: str, index: int, call_id: str, score: float = 0.25,
              after: str | None = None) -> ScoredTurn:  # fmt: skip
    """A judged reply that called the tool (`after`: the call whose result it was shown)."""
    turn = scored_turn(session, turn_index=index, score=score)
    messages = [QUESTION, *(_exchange(after) if after else [])]
    response = {"role": "assistant", "content": "", "tool_calls": [_call(call_id)]}
    return turn.model_copy(update={"messages": messages, "response": response})


def _exchange(call_id: str) -> list[dict[str, Any]]:
    return [
        {"role": "assistant", "content": "", "tool_calls": [_call(call_id)]},
        {"role": "tool", "tool_call_id": call_id, "content": "Oslo: rain, 4 C"},
    ]


def answer_turn(session: str, index: int, call_id: str, score: float) -> ScoredTurn:
    """A judged plain reply to the result of call `call_id`."""
    turn = scored_turn(session, turn_index=index, score=score)
    response = {"role": "assistant", "content": "Rain in Oslo, 4 C."}
    return turn.model_copy(
        update={"messages": [QUESTION, *_exchange(call_id)], "response": response}
    )


async def batches(client: aredis.Redis) -> list[TrainingBatch]:
    return [bus.decode(f, TrainingBatch) for _id, f in await client.xrange("liveloop:batches")]


def lone(turn: ScoredTurn, at: float = 0.0) -> list[PendingSample]:
    return [PendingSample(f"id-{turn.key}", turn, at)]


def scores(groups: list[list[PendingSample]]) -> dict[str, float]:
    return {p.key: round(p.turn.score, 6) for g in groups for p in g}


def test_call_and_answer_ids_follow_the_openai_contract() -> None:
    assert call_ids(call_turn("s", 0, "c1")) == ["c1"]
    assert answered_ids(answer_turn("s", 1, "c1", 1.0)) == ["c1"]
    assert call_ids(answer_turn("s", 1, "c1", 1.0)) == []
    assert answered_ids(scored_turn("s", turn_index=2)) == []  # ends with a user message


def test_a_call_waits_for_its_answer_and_takes_a_share_of_its_score() -> None:
    credit = CallCredit(weight=0.5, wait_s=60)
    call = call_turn("s", 0, "c1", score=0.25)
    assert credit.route([lone(call)], now=0) == []  # held
    assert len(credit) == 1
    answer = answer_turn("s", 1, "c1", score=1.0)
    got = scores(credit.route([lone(answer)], now=5))
    assert got == {answer.key: 1.0, call.key: 0.625}
    bad = CallCredit(weight=0.5, wait_s=60)
    bad.route([lone(call_turn("s", 0, "c1", score=0.25))], now=0)
    got = scores(bad.route([lone(answer_turn("s", 1, "c1", score=-1.0))], now=5))
    assert got[call.key] == -0.375 and bad.credited == 1 and len(bad) == 0


def test_an_answer_in_another_session_or_to_another_call_credits_nothing() -> None:
    credit = CallCredit(weight=1.0, wait_s=60)
    credit.route([lone(call_turn("s", 0, "c1"))], now=0)
    other = [lone(answer_turn("t", 1, "c1", 1.0)), lone(answer_turn("s", 1, "c2", 1.0))]
    assert len(credit.route(other, now=1)) == 2
    assert len(credit) == 1 and credit.credited == 0


def test_a_chain_of_calls_is_credited_by_the_final_answer() -> None:
    credit = CallCredit(weight=1.0, wait_s=60)
    first, second = call_turn("s", 0, "c1"), call_turn("s", 1, "c2", after="c1")
    assert credit.route([lone(first)], now=0) == []
    assert credit.route([lone(second)], now=1) == []  # a call itself: both wait
    got = scores(credit.route([lone(answer_turn("s", 2, "c2", score=0.8))], now=2))
    assert got == {"s:2:0": 0.8, second.key: 0.8, first.key: 0.8}


def test_an_unanswered_call_goes_on_with_its_own_score_after_the_wait() -> None:
    credit = CallCredit(weight=0.5, wait_s=10)
    call = call_turn("s", 0, "c1", score=0.25)
    credit.route([lone(call)], now=0)
    assert credit.route([], now=9) == []
    assert scores(credit.route([], now=10)) == {call.key: 0.25}
    assert credit.expired == 1 and len(credit) == 0


def test_an_answer_judged_before_its_call_still_credits_it() -> None:
    credit = CallCredit(weight=0.5, wait_s=60)
    assert len(credit.route([lone(answer_turn("s", 1, "c1", score=1.0))], now=0)) == 1
    call = call_turn("s", 0, "c1", score=0.25)
    assert scores(credit.route([lone(call)], now=1)) == {call.key: 0.625}


def test_weight_zero_and_groups_of_several_samples_are_never_held() -> None:
    off = CallCredit(weight=0.0, wait_s=60)
    assert len(off.route([lone(call_turn("s", 0, "c1"))], now=0)) == 1
    on = CallCredit(weight=0.5, wait_s=60)
    pair = [*lone(call_turn("s", 0, "c1")), *lone(call_turn("s", 0, "c9"))]
    assert on.route([pair], now=0) == [pair] and len(on) == 0


def test_a_deleted_tenants_waiting_calls_are_dropped() -> None:
    credit = CallCredit(weight=0.5, wait_s=60)
    credit.route([lone(call_turn("s", 0, "c1"))], now=0)
    assert [p.key for p in credit.drop_tenant("t")] == ["s:0:0"]
    assert len(credit) == 0 and credit.route([], now=100) == []


@pytest.mark.parametrize(("weight", "credited"), [(0.5, 0.625), (0.0, 0.25)])
async def test_the_collector_batches_a_call_with_its_answers_credit(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path, weight: float, credited: float
) -> None:
    settings = settings_for(redis_url, data_dir, collector={**FAST, "call_credit": weight})
    collector = Collector(settings.shared(), settings.collector, client=aredis_client)
    await collector.start()
    await publish_turns(aredis_client, [call_turn("s", 0, "c1", score=0.25)])
    for _ in range(3):
        await collector.step(block_ms=20)
        await asyncio.sleep(0.06)
    if weight > 0:  # the call waits for its answer's judgment, pending in the group
        assert await aredis_client.xlen("liveloop:batches") == 0
        pending = await aredis_client.xpending("liveloop:scored", "collector")
        assert pending["pending"] == 1
    await publish_turns(aredis_client, [answer_turn("s", 1, "c1", score=1.0)])

    async def both_batched() -> bool:
        await collector.step(block_ms=20)
        return sum(len(b.samples or []) for b in await batches(aredis_client)) == 2

    await wait_for(both_batched, timeout_s=10, what="both turns batched")
    by_key = {s.key: s for b in await batches(aredis_client) for s in b.samples or []}
    assert by_key["s:0:0"].score == pytest.approx(credited)
    assert by_key["s:1:0"].score == pytest.approx(1.0)
    text = collector.metrics.registry
    answered = text.get_sample_value(
        "liveloop_collector_credited_calls_total", {"outcome": "answered"}
    )
    assert answered == (1.0 if weight > 0 else 0.0)

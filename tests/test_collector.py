"""The collecting loop against a real Valkey: staleness, advantages, packing, exactly-once."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import redis.asyncio as aredis

from liveloop import bus
from liveloop.collector.advantages import (
    POOLED,
    TASK_MARK,
    Baselines,
    PendingSample,
    task_key,
)
from liveloop.collector.loop import Collector
from liveloop.collector.packing import FlushPolicy, first_fit
from liveloop.collector.writer import BatchWriter
from liveloop.config import ConfigError
from liveloop.contracts import ScoredTurn, TrainingBatch
from liveloop.trainer.source import load_batch_file
from tests.conftest import wait_for
from tests.test_collector_support import announce, publish_turns, scored_turn, settings_for

# No trainer reads the batches here: the bound on batches waiting for it is lifted, except
# in the test of that bound.
FAST = {"group_wait_s": 0.0, "min_turns": 1, "max_wait_s": 0.05, "max_queued_batches": None}


async def batches(client: aredis.Redis) -> list[TrainingBatch]:
    return [bus.decode(f, TrainingBatch) for _id, f in await client.xrange("liveloop:batches")]


async def make_collector(
    client: aredis.Redis, redis_url: str, data_dir: Path, max_staleness: int = 4, **cfg: object
) -> Collector:
    settings = settings_for(
        redis_url, data_dir, max_staleness=max_staleness, collector={**FAST, **cfg}
    )
    collector = Collector(settings.shared(), settings.collector, client)
    await collector.start()
    return collector


async def run_steps(collector: Collector, n: int = 3) -> None:
    for _ in range(n):
        await collector.step(block_ms=20)
        await asyncio.sleep(0.06)


async def test_stale_turns_are_dropped_and_counted(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    await announce(aredis_client, 5)
    turns = [
        scored_turn("fresh", versions=[5, 5]),
        scored_turn("edge", versions=[3, 5]),  # 2 behind: allowed with max_staleness 2
        scored_turn("old", versions=[2, 5]),  # 3 behind: dropped
    ]
    await publish_turns(aredis_client, turns)
    collector = await make_collector(aredis_client, redis_url, data_dir, max_staleness=2)
    await run_steps(collector)
    got = await batches(aredis_client)
    keys = sorted(s.key for b in got for s in b.samples or [])
    assert keys == ["edge:0:0", "fresh:0:0"]
    assert all(b.trainer_version == 5 for b in got)
    assert collector.metrics.dropped.labels("stale")._value.get() == 1
    assert await collector.consumer.lag() == (0, 0)  # everything acknowledged


async def test_on_policy_only_with_max_staleness_zero(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    await announce(aredis_client, 2)
    await publish_turns(
        aredis_client,
        [scored_turn("a", versions=[2, 2]), scored_turn("b", versions=[1, 2])],
    )
    collector = await make_collector(aredis_client, redis_url, data_dir, max_staleness=0)
    await run_steps(collector)
    keys = [s.key for b in await batches(aredis_client) for s in b.samples or []]
    assert keys == ["a:0:0"]


async def test_group_normalised_advantages_and_per_judge_baseline(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    scores = [1.0, 0.0, -1.0]
    group = [scored_turn("g", sample_index=i, score=s, judge="m") for i, s in enumerate(scores)]
    lone = [
        scored_turn("x1", score=1.0, judge="rules"),
        scored_turn("y1", score=-0.5, judge="llm"),
    ]
    await publish_turns(aredis_client, [group[0], lone[0], lone[1], group[1], group[2]])
    collector = await make_collector(aredis_client, redis_url, data_dir, group_wait_s=0.3)
    await collector.step(block_ms=20)
    assert await batches(aredis_client) == []  # the group is still open

    async def all_batched() -> bool:  # once the group closes (group_wait_s), steps ship it
        await collector.step(block_ms=20)
        return sum(len(b.samples or []) for b in await batches(aredis_client)) == 5

    await wait_for(all_batched)
    adv = {s.key: s.advantage for b in await batches(aredis_client) for s in b.samples or []}
    std = math.sqrt(2 / 3)
    assert adv["g:0:0"] == pytest.approx(1 / std)
    assert adv["g:0:1"] == pytest.approx(0.0)
    assert adv["g:0:2"] == pytest.approx(-1 / std)
    # Each lone turn is the first of its judge: nothing to measure it against, no signal.
    assert adv["x1:0:0"] == 0.0
    assert adv["y1:0:0"] == 0.0


def test_running_baseline_is_a_bias_corrected_ema_per_judge() -> None:
    baselines = Baselines(decay=0.9)

    def lone(score: float, judge: str = "rules") -> float:
        p = PendingSample("0-1", scored_turn("s", score=score, judge=judge), 0.0)
        baselines.assign([p])
        return p.advantage

    assert lone(1.0) == 0.0  # nothing seen yet: no baseline, no signal
    assert lone(0.0) == pytest.approx(-1.0)  # baseline = 1.0 after one score
    # after [1, 0]: raw = 0.9 * 0.1 + 0.1 * 0 = 0.09, corrected 0.09 / (1 - 0.81)
    assert lone(0.5) == pytest.approx(0.5 - 0.09 / 0.19)
    assert lone(0.5, judge="llm") == 0.0  # another judge, own baseline: its first score
    assert lone(-0.5, judge="llm") == pytest.approx(-1.0)
    # A group with equal scores carries no signal.
    group = [
        PendingSample(str(i), scored_turn("e", sample_index=i, score=0.3), 0.0) for i in (0, 1)
    ]
    baselines.assign(group)
    assert [p.advantage for p in group] == [0.0, 0.0]


def test_judges_can_share_one_baseline() -> None:
    """Feedback on a session's last reply and the rules judge's reading of the replies
    before it measure one outcome: pooled, a -1 is measured against both."""
    pooled, split = Baselines(decay=0.9, per_judge=False), Baselines(decay=0.9)
    for baselines in (pooled, split):
        for _ in range(5):
            baselines.assign(
                [PendingSample("f", scored_turn("a", score=-1.0, judge="feedback"), 0)]
            )
            baselines.assign([PendingSample("r", scored_turn("b", score=1.0, judge="rules"), 0)])
    made_up = [PendingSample("x", scored_turn("c", score=-1.0, judge="feedback"), 0.0)]
    pooled.assign(made_up)
    assert made_up[0].advantage < -1.0  # against a mean above 0: the rules judge's +1s count
    split.assign(made_up)
    assert made_up[0].advantage == pytest.approx(0.0)  # against feedback's -1s only
    assert set(pooled.by_judge) == {POOLED}
    restored = Baselines(decay=0.9, per_judge=False)
    restored.load(pooled.dump())
    assert restored.get(POOLED).value == pytest.approx(pooled.get(POOLED).value)


def with_tool(turn: ScoredTurn, name: str = "get_weather") -> ScoredTurn:
    tool = {"type": "function", "function": {"name": name, "parameters": {}}}
    return turn.model_copy(update={"tools": [tool]})


def test_a_task_that_always_fails_is_measured_against_its_own_baseline() -> None:
    baselines = Baselines(decay=0.9, scope="task", min_task_turns=3)

    def lone(turn: ScoredTurn) -> float:
        p = PendingSample("0-1", turn, 0.0)
        baselines.assign([p])
        return p.advantage

    for i in range(6):  # chat turns please the user
        lone(scored_turn(f"c{i}", score=1.0))
    weather = [lone(with_tool(scored_turn(f"w{i}", score=-1.0))) for i in range(6)]
    # Until the tool task has 3 scores it is measured against the judge's baseline (its
    # first score against all 1.0); from then on against its own, which is -1: no push.
    assert weather[0] == pytest.approx(-2.0)
    assert weather[3:] == pytest.approx([0.0, 0.0, 0.0])
    # Its first success stands out; a chat turn that fails is measured against the chats.
    assert lone(with_tool(scored_turn("w-ok", score=1.0))) == pytest.approx(2.0)
    assert lone(scored_turn("c-bad", score=-1.0)) == pytest.approx(-2.0)
    assert baselines.get("rules").count == 14  # the judge-wide baseline sees every score
    # With scope "judge" the tool turns are measured against everyone's scores.
    judge_only = Baselines(decay=0.9, scope="judge")
    for turn in [scored_turn("c", score=1.0), with_tool(scored_turn("w", score=-1.0))]:
        judge_only.assign([p := PendingSample("0-1", turn, 0.0)])
    assert p.advantage == pytest.approx(-2.0) and judge_only.by_task == {}
    # The system prompt is part of the task; the user's words are not.
    agent = scored_turn("s", score=0.0)
    system = [{"role": "system", "content": "You are a travel agent."}, *agent.messages]
    other = agent.model_copy(
        update={"messages": [*agent.messages, {"role": "user", "content": "x"}]}
    )
    assert task_key(agent) == task_key(other)
    assert task_key(agent) != task_key(agent.model_copy(update={"messages": system}))
    assert task_key(with_tool(agent)) != task_key(with_tool(agent, "get_time"))


def test_task_baselines_are_bounded_and_the_oldest_dropped() -> None:
    baselines = Baselines(decay=0.9, scope="task", max_tasks=2)
    for name in ("a", "b", "a", "c"):  # "b" is then the least recently scored
        turn = with_tool(scored_turn(name), name)
        baselines.update(turn, baselines.task_name(turn))
    kept = {n.split(TASK_MARK)[1] for n in baselines.by_task}
    assert kept == {task_key(with_tool(scored_turn("x"), n)) for n in ("a", "c")}
    (dropped,) = baselines.take_dropped()
    assert dropped.split(TASK_MARK)[1] == task_key(with_tool(scored_turn("x"), "b"))
    assert baselines.take_dropped() == []


@pytest.mark.parametrize("scope", ["judge", "task"])
async def test_reward_baselines_survive_a_restart(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path, scope: str
) -> None:
    await publish_turns(aredis_client, [scored_turn(f"a{i}", score=1.0) for i in range(3)])
    first = await make_collector(aredis_client, redis_url, data_dir, baseline_scope=scope)
    await run_steps(first)
    before = first.baselines.get("rules")
    assert before.count == 3 and before.value == pytest.approx(1.0)
    # A new process (the first one crashed): it starts from the stored baselines, not zero.
    await publish_turns(aredis_client, [scored_turn("b0", score=0.0)])
    second = await make_collector(aredis_client, redis_url, data_dir, baseline_scope=scope)
    assert second.baselines.get("rules") == before
    assert second.metrics.baseline.labels("rules")._value.get() == pytest.approx(1.0)
    await run_steps(second)
    adv = {s.key: s.advantage for b in await batches(aredis_client) for s in b.samples or []}
    assert adv["b0:0:0"] == pytest.approx(-1.0)  # 0.0 against the baseline 1.0, not 0
    third = await make_collector(aredis_client, redis_url, data_dir, baseline_scope=scope)
    assert third.baselines.get("rules").count == 4
    assert third.baselines.by_task == second.baselines.by_task  # per task too
    assert (third.baselines.by_task != {}) == (scope == "task")


async def test_dropped_task_baselines_leave_redis(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    async def stored() -> set[str]:
        return {str(k) for k in await aredis_client.hkeys("liveloop:collector:baselines")}

    turns = [with_tool(scored_turn(f"t{i}", score=1.0), f"tool{i}") for i in range(3)]
    await publish_turns(aredis_client, turns[:2])
    collector = await make_collector(
        aredis_client, redis_url, data_dir, baseline_scope="task", baseline_max_tasks=2
    )
    await run_steps(collector)
    first_two = set(collector.baselines.by_task)
    assert await stored() == {"rules", *first_two} and len(first_two) == 2
    await publish_turns(aredis_client, turns[2:])  # a third task: the oldest goes
    await run_steps(collector)
    assert await stored() == {"rules", *collector.baselines.by_task}
    assert len(first_two - set(collector.baselines.by_task)) == 1


def pending(tokens: int, key: str, arrived: float = 0.0) -> PendingSample:
    turn = scored_turn(key, prompt_len=tokens - 1, completion_len=1)
    return PendingSample(f"id-{key}", turn, arrived)


def test_sorted_first_fit_packing_and_flush_policy() -> None:
    items = [pending(n, f"k{n}") for n in (30, 60, 20, 50, 40)]
    bins = first_fit(items, budget=100)
    assert [[p.tokens for p in b.samples] for b in bins] == [[60, 40], [50, 30, 20]]
    assert [b.tokens for b in bins] == [100, 100]
    # A turn over the budget gets a batch of its own.
    assert [b.tokens for b in first_fit([pending(150, "big"), pending(10, "s")], 100)] == [150, 10]

    policy = FlushPolicy(token_budget=100, min_turns=3, min_fill=0.5, max_wait_s=10.0)
    few = [pending(10, "a", arrived=0.0), pending(10, "b", arrived=1.0)]
    ship, keep = policy.split(few, now=5.0)
    assert ship == [] and len(keep) == 2  # 2 turns, 20 tokens, waited 5 s: not yet
    ship, keep = policy.split(few, now=10.0)
    assert len(ship) == 1 and keep == []  # the oldest waited max_wait_s
    ship, _ = policy.split([pending(60, "full")], now=0.0)
    assert len(ship) == 1  # over min_fill of the budget
    # With a limit, that many batches ship at most, packed from the freshest turns.
    old = PendingSample("id-old", scored_turn("old", prompt_len=9, versions=[1]), 5.0)
    new = [PendingSample(f"id-{k}", scored_turn(k, prompt_len=9, versions=[3]), 0.0) for k in "ab"]
    ship, keep = FlushPolicy(20, 1, 0.5, 10.0).split([old, *new], now=6.0, limit=1)
    assert [sorted(p.key for p in b.samples) for b in ship] == [["a:0:0", "b:0:0"]]
    assert keep == [old]


async def trainer_takes_a_batch(client: aredis.Redis) -> None:
    """Read one batch in the trainer's group, as the trainer does before an update."""
    await client.xreadgroup(bus.TRAINER_GROUP, "t1", {"liveloop:batches": ">"}, count=1)


async def test_a_full_trainer_queue_holds_turns_and_the_freshest_ship_next(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    """A trainer slower than the traffic gets fresh batches, not a stale backlog."""
    await aredis_client.xgroup_create("liveloop:batches", bus.TRAINER_GROUP, id="0", mkstream=True)
    await announce(aredis_client, 2)
    collector = await make_collector(
        aredis_client, redis_url, data_dir, max_queued_batches=1, min_turns=2, token_budget=64,
        min_fill=1.0,
    )  # fmt: skip

    def turn(key: str, version: int) -> ScoredTurn:  # 20 tokens: three fill a batch
        return scored_turn(key, prompt_len=6, versions=[version] * 14)

    await publish_turns(aredis_client, [turn("first1", 2), turn("first2", 2)])
    await run_steps(collector)
    assert [len(b.samples or []) for b in await batches(aredis_client)] == [2]
    # The trainer has not read it: what arrives now is held, the older turns first in line.
    await publish_turns(aredis_client, [turn("old1", 0), turn("old2", 0)])
    await publish_turns(aredis_client, [turn(f"new{i}", 2) for i in range(3)])
    await run_steps(collector)
    assert len(await batches(aredis_client)) == 1
    assert collector.metrics.queued_batches._value.get() == 1
    assert len(collector.held) == 5
    # The trainer takes the batch: the next one holds the three freshest turns.
    await trainer_takes_a_batch(aredis_client)
    await run_steps(collector)
    got = await batches(aredis_client)
    assert [sorted(s.key for s in b.samples or []) for b in got[1:]] == [
        ["new0:0:0", "new1:0:0", "new2:0:0"]
    ]
    # The trainer moves on to v5: the held turns of v0 are now too stale and are dropped.
    await announce(aredis_client, 5)
    assert await collector.versions.current(force=True) == 5
    await trainer_takes_a_batch(aredis_client)

    async def dropped_stale() -> bool:
        await run_steps(collector, 1)
        return bool(collector.metrics.dropped.labels("stale")._value.get() == 2)

    await wait_for(dropped_stale, 5, what="held v0 turns dropped as stale")
    assert len(await batches(aredis_client)) == 2
    assert not collector.held and await collector.consumer.lag() == (0, 0)


async def test_packs_by_token_budget(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    turns = [scored_turn(f"s{i}", prompt_len=40, completion_len=10) for i in range(5)]
    await publish_turns(aredis_client, turns)
    collector = await make_collector(aredis_client, redis_url, data_dir, token_budget=120)
    await run_steps(collector)
    got = await batches(aredis_client)
    assert sorted(len(b.samples or []) for b in got) == [1, 2, 2]
    assert all(b.num_tokens <= 120 for b in got)


async def test_large_batch_goes_by_reference(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    turns = [scored_turn(f"s{i}", prompt_len=100, completion_len=50) for i in range(4)]
    await publish_turns(aredis_client, turns)
    collector = await make_collector(aredis_client, redis_url, data_dir, inline_max_bytes=1024)
    await run_steps(collector)
    [batch] = await batches(aredis_client)
    assert batch.samples is None and batch.path is not None
    assert not Path(batch.path).is_absolute()
    samples = load_batch_file(data_dir, batch.path)
    assert sorted(s.key for s in samples) == [f"s{i}:0:0" for i in range(4)]
    by_key = {t.key: t for t in turns}
    assert all(s.completion_token_ids == by_key[s.key].completion_token_ids for s in samples)


async def test_side_empty_and_unreadable_turns(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    await publish_turns(aredis_client, [scored_turn("side", turn_type="side")])
    await publish_turns(aredis_client, [scored_turn("empty", versions=[])])
    await aredis_client.xadd("liveloop:scored", {"data": "{not json"})
    collector = await make_collector(aredis_client, redis_url, data_dir)
    await run_steps(collector)
    assert await batches(aredis_client) == []
    assert collector.metrics.dropped.labels("side")._value.get() == 1
    assert collector.metrics.dropped.labels("empty")._value.get() == 1
    dead = await aredis_client.xrange("liveloop:scored:dlq")
    assert len(dead) == 1 and "unreadable" in dead[0][1]["error"]
    assert await collector.consumer.lag() == (0, 0)


async def test_redelivered_turns_are_batched_once(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    turns = [scored_turn(f"s{i}") for i in range(3)]
    await publish_turns(aredis_client, turns)
    # Collector "a" reads the turns and dies before batching them (group still open).
    first = await make_collector(
        aredis_client, redis_url, data_dir, group_wait_s=60.0, consumer={"claim_idle_ms": 300_000}
    )
    first.consumer.consumer = "a"
    await first.step(block_ms=20)
    assert await batches(aredis_client) == [] and len(first.held) == 3
    # Restarted as "a": its pending entries come back and are batched.
    again = await make_collector(aredis_client, redis_url, data_dir)
    again.consumer.consumer = "a"
    await run_steps(again)
    assert len(await batches(aredis_client)) == 1
    # The same turns published again (a judge retried) are acknowledged, not re-batched.
    await publish_turns(aredis_client, turns)
    await run_steps(again)
    assert len(await batches(aredis_client)) == 1
    assert again.metrics.dropped.labels("duplicate")._value.get() == 3
    assert await again.consumer.lag() == (0, 0)


async def test_writer_is_exactly_once_per_batch_and_per_turn(
    aredis_client: aredis.Redis, data_dir: Path
) -> None:
    writer = BatchWriter(aredis_client, data_dir)
    samples = [pending(10, k).to_batch_sample() for k in ("a", "b", "c")]
    assert (await writer.write(samples[:2], 0)).status == "ok"
    assert (await writer.write(list(reversed(samples[:2])), 0)).status == "dup"
    overlap = await writer.write(samples[1:], 0)
    assert overlap.status == "taken" and overlap.taken_key == samples[1].key
    assert await writer.already_batched([s.key for s in samples]) == {"a:0:0", "b:0:0"}
    assert len(await batches(aredis_client)) == 1


def test_settings_refuse_a_claim_timeout_shorter_than_the_batch_wait(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"collector: .*claim_idle_ms"):
        settings_for("redis://unused", tmp_path, collector={"max_wait_s": 100.0})

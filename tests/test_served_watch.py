"""The served-quality watch: a version whose served turns went bad is rolled back."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio as aredis
from safetensors.torch import load_file

from liveloop.collector.writer import BatchWriter
from liveloop.config.watch import WatchSettings
from liveloop.evaluation import format_table, quality_rows
from liveloop.quality import QualityStore, VersionQuality
from liveloop.registry import Registry
from liveloop.trainer.safeguards.watch import ServedWatch, Stage
from liveloop.trainer.source import Publisher
from liveloop.weights.transport import SharedDiskTransport
from tests.test_collector_support import settings_for, trainer_of
from tests.test_quality_and_gate import _announced
from tests.test_trainer import make_samples


def served(version: int, judged: int, mean: float, sd: float) -> VersionQuality:
    return VersionQuality(version=version, judged=judged, mean_reward=mean, reward_sd=sd)


def test_only_a_clear_fall_in_served_reward_is_rolled_back() -> None:
    """A fall must beat both the margin and the noise; short-lived versions are skipped."""
    settings = WatchSettings(min_turns=20, reward_margin=0.3, z=2.33)
    watch = ServedWatch(settings, [0], loadable=lambda version: version != 2)
    for version in (1, 2, 3, 4):
        watch.went_live(version)
    found = {0: served(0, 40, -0.2, 0.7), 1: served(1, 5, -0.9, 0.1)}
    assert watch.check(found) is None  # v1 has too few turns, and nothing after it has more
    assert watch.pending == [1, 2, 3, 4] and [s.version for s in watch.good] == [0]

    # v2: 0.4 below v0 (beyond the margin) but over 20 noisy turns, z = 1.7: not a rollback.
    # v3: significantly below v0 and v2 together (-0.333, z = 2.6) but by 0.27, inside the
    # margin: not one either.
    found |= {2: served(2, 20, -0.6, 0.9), 3: served(3, 100, -0.6, 0.1)}
    assert watch.check(found) is None
    assert watch.pending == [4] and [s.version for s in watch.good] == [0, 2, 3]  # v1 skipped

    found[4] = served(4, 24, -0.9, 0.3)  # 0.4 below v0, v2 and v3 together, z = 5.5
    rollback = watch.check(found)
    assert rollback is not None  # to the newest good version still on disk (v2's is gone)
    assert (rollback.target, rollback.culprit, rollback.abandoned) == (3, 4, [4])
    assert rollback.reason.startswith(
        "served reward v4 -0.900 over 24 turns is below the last good versions' "
        "(v0, v2, v3: -0.500 over 160 turns) by 0.400 (> 0.3, and 5.5 > 2.33 standard errors)"
    )
    assert watch.keep() == {0, 2, 3, 4}  # the good ones, and the next to check, stay on disk

    watch.rolled_back(5)
    assert watch.pending == [5] and watch.rollbacks == 1
    assert watch.check(found | {5: served(5, 3, 0.0, 1.0)}) is None

    # No good version's checkpoint left: a version that fell is not rolled back, nor is it
    # taken as good (the next one is compared with v0 alone).
    stranded = ServedWatch(settings, [0, 1, 2], loadable=lambda version: False)
    found = {0: served(0, 40, -0.2, 0.7), 1: found[4], 2: served(2, 20, -0.3, 0.7)}
    assert stranded.check(found) is None
    assert stranded.pending == [] and [s.version for s in stranded.good] == [0, 2]


def test_a_version_whose_served_replies_drifted_is_rolled_back_once_measured() -> None:
    """The reference-NLL bound waits for a version's served tokens, then compares them."""
    found = {0: VersionQuality(version=0, judged=40, mean_reward=-0.5, reward_sd=0.8,
                               ref_nll=2.8, ref_tokens=1500)}  # fmt: skip
    found[1] = served(1, 25, -0.5, 0.8)  # judged, but none of its tokens measured yet
    found[2] = served(2, 24, -0.4, 0.8)
    watch = ServedWatch(WatchSettings(min_turns=20), [0, 1, 2], lambda v: True, drift=True)
    assert watch.wanted() == [0, 1, 2]
    assert watch.check(found) is None and watch.pending == [1, 2]  # they wait for their tokens
    assert watch.stages() == {1: Stage.TURNS_IN, 2: Stage.TURNS_IN}
    assert watch.version0_nll == 2.8

    # A version with its turns but not its tokens when a later one is ready is judged on
    # its turns, and a few measured tokens (below min_ref_tokens) do not count against it.
    early = ServedWatch(WatchSettings(min_turns=20), [0, 1, 2], lambda v: True, drift=True)
    few = found[1].model_copy(update={"ref_nll": 9.9, "ref_tokens": 100})
    ready = found[2].model_copy(update={"ref_nll": 2.9, "ref_tokens": 800})
    assert early.check({**found, 1: few, 2: ready}) is None
    assert [s.version for s in early.good] == [0, 1, 2] and early.pending == []

    found[1] = found[1].model_copy(update={"ref_nll": 3.0, "ref_tokens": 900})  # 1.07 x v0's
    found[2] = found[2].model_copy(update={"ref_nll": 4.2, "ref_tokens": 800})  # 1.5 x
    rollback = watch.check(found)  # v2's reward is fine; its replies are 1.5 x v0's NLL
    assert rollback is not None and (rollback.target, rollback.culprit) == (1, 2)
    assert rollback.reason == (
        "reference NLL of v2's served replies 4.200 per token (over 800 tokens) > 1.4 x "
        "version 0's 2.800"
    )
    assert rollback.reasons(3) == {2: f"{rollback.reason}; rolled back to v1 as v3"}

    # Short replies: 20 measured replies of 450 tokens are enough to judge a version's NLL.
    short = ServedWatch(WatchSettings(min_turns=20), [0, 1], lambda v: True, drift=True)
    few = found[1].model_copy(update={"ref_nll": 4.2, "ref_tokens": 450, "ref_replies": 19})
    assert short.check({0: found[0], 1: few}) is None and short.pending == [1]  # waits
    enough = few.model_copy(update={"ref_replies": 20})
    rollback = short.check({0: found[0], 1: enough})
    assert rollback is not None and (rollback.target, rollback.culprit) == (0, 1)

    # Where drift is not measured (or the model has no language), only the reward counts.
    unmeasured = ServedWatch(WatchSettings(min_turns=20), [0, 1, 2], lambda v: True)
    assert unmeasured.check(found) is None and unmeasured.pending == []


def test_a_fall_in_served_reward_does_not_wait_for_the_tokens_to_be_measured() -> None:
    """The trainer measures a version's served tokens only when it trains on them, versions
    later; a version whose judged turns already show a fall is rolled back before that."""
    found = {0: VersionQuality(version=0, judged=40, mean_reward=-0.3, reward_sd=0.6,
                               ref_nll=2.8, ref_tokens=1500)}  # fmt: skip
    found[1] = served(1, 22, -0.3, 0.6)  # as good as v0, its tokens not measured yet
    found[2] = served(2, 8, -0.9, 0.3)  # too few turns to tell
    watch = ServedWatch(WatchSettings(min_turns=20), [0], lambda v: True, drift=True)
    for version in (1, 2, 3):
        watch.went_live(version)
    assert watch.check(found) is None and watch.pending == [1, 2, 3]
    assert watch.stages() == {1: Stage.TURNS_IN, 2: Stage.WAITING, 3: Stage.WAITING}

    found[2] = served(2, 24, -0.9, 0.3)  # 0.6 below v0, z = 4.6: a fall, tokens or not
    rollback = watch.check(found)
    assert rollback is not None
    assert (rollback.target, rollback.culprit, rollback.abandoned) == (0, 2, [1, 2, 3])
    assert rollback.reasons(4) == {
        1: "went live before v2, rolled back to v0 as v4 with it",
        2: f"{rollback.reason}; rolled back to v0 as v4",
        3: "went live after v2, rolled back to v0 as v4 with it",
    }
    assert [s.version for s in watch.good] == [0]  # v1 is not good until its tokens are


def test_versions_replaced_before_their_turns_are_in_are_compared_together() -> None:
    """A tenant's adapter versions each serve a few turns before the next: no one of them
    has min_turns, but the newest together do, and a fall of theirs is rolled back."""
    settings = WatchSettings(min_turns=20, reward_margin=0.3, z=2.33)
    watch = ServedWatch(settings, [0], lambda v: True, whose=" of tenant ta")
    for version in (2, 5, 7, 9):
        watch.went_live(version)
    found = {0: served(0, 30, -0.4, 0.6), 2: served(2, 9, -0.5, 0.5), 5: served(5, 8, -0.2, 0.6)}
    assert watch.check(found) is None  # 17 turns of v2 and v5 together: too few to tell
    assert watch.pending == [2, 5, 7, 9] and watch.stages()[5] is Stage.WAITING
    found |= {7: served(7, 7, -0.9, 0.3), 9: served(9, 6, -1.0, 0.0)}
    assert watch.check(found) is None  # v5, v7 and v9: 21 turns, -0.662, inside the margin
    found[9] = served(9, 13, -1.0, 0.0)  # 20 together, 0.57 below v0, z = 4.6
    rollback = watch.check(found)
    assert rollback is not None
    assert (rollback.target, rollback.culprit, rollback.abandoned) == (0, 7, [2, 5, 7, 9])
    assert rollback.reason.startswith(
        "served reward of v7, v9 together -0.965 over 20 turns is below the last good "
        "versions' (v0: -0.400 over 30 turns) by 0.565"
    )
    # The same turns no worse than v0's: no rollback, and none of them is judged good.
    calm = ServedWatch(settings, [0, 2, 5, 7, 9], lambda v: True)
    level = {v: served(v, 8, -0.45, 0.6) for v in (2, 5, 7, 9)}
    assert calm.check({0: found[0], **level}) is None
    assert [s.version for s in calm.good] == [0] and calm.pending == [2, 5, 7, 9]


def test_a_base_replaced_before_its_turns_were_in_is_still_the_baseline() -> None:
    """A tenant's base serves it only until its first adapter: with min_base_turns it is
    compared with, not skipped; with fewer the first version is taken as good unchecked."""
    settings = WatchSettings(min_turns=20, min_base_turns=8, reward_margin=0.3, z=2.33)
    base = served(0, 9, -0.2, 0.6)
    watch = ServedWatch(settings, [0, 1], lambda v: True, whose=" of tenant ta")
    assert watch.check({0: base, 1: served(1, 12, -0.9, 0.3)}) is None  # v1's turns not in
    assert watch.pending == [0, 1] and not watch.good
    rollback = watch.check({0: base, 1: served(1, 24, -0.9, 0.3)})  # 0.7 below, z = 3.3
    assert rollback is not None and (rollback.target, rollback.culprit) == (0, 1)
    assert "(v0: -0.200 over 9 turns) by 0.700" in rollback.reason
    assert [s.version for s in watch.good] == [0]

    # Versions each too short-lived for min_turns, together past it: the base is taken too.
    brief = ServedWatch(settings, [0, 1, 2], lambda v: True)
    rollback = brief.check({0: base, 1: served(1, 10, -1.0, 0.0), 2: served(2, 10, -1.0, 0.0)})
    assert rollback is not None and (rollback.target, rollback.culprit) == (0, 1)

    level = ServedWatch(settings, [0, 1], lambda v: True)
    assert level.check({0: base, 1: served(1, 24, -0.3, 0.6)}) is None
    assert [s.version for s in level.good] == [0, 1] and level.pending == []

    # Fewer than min_base_turns: too few to stand for the base; v1 passes unchecked.
    thin = ServedWatch(settings, [0, 1], lambda v: True)
    assert thin.check({0: served(0, 5, +0.6, 0.5), 1: served(1, 24, -0.9, 0.3)}) is None
    assert [s.version for s in thin.good] == [1]


def test_a_version_pruned_before_the_watch_judged_it_keeps_its_registry_row(
    tmp_path: Path,
) -> None:
    """Short replies can keep the watch from judging a version until newer ones have pushed
    its checkpoint out; its registry row stays until the watch has judged it, so that a
    rollback can still say which version fell and why."""
    registry = Registry.open(f"sqlite:///{tmp_path / 'registry.sqlite'}")
    try:
        publisher = Publisher(SharedDiskTransport(tmp_path), registry, None)
        for version in (1, 2, 3, 4):
            registry.add_model_version(version, str(tmp_path / f"v{version}"), version - 1)
        # v1 and v2 pruned; v1 judged, v2 not yet
        publisher.forget(on_disk=frozenset({3, 4}), keep=frozenset({2, 3, 4}))
        assert registry.get_model_version(1) is None
        assert registry.get_model_version(2) is not None

        publisher.mark_rolled_back({2: "served worse", 3: "went live after v2"})
        publisher.forget(frozenset({3, 4}), keep=frozenset({5}))  # the rollback's new version
        assert [registry.get_model_version(v) is not None for v in (2, 3, 4)] == [True] * 3
        kept = registry.get_model_version(2)
        assert kept is not None and (kept.status, kept.reason) == ("rolled_back", "served worse")

        publisher.forget(frozenset({3}), keep=frozenset({4}))  # pruned, then judged good:
        publisher.forget(frozenset({3}), keep=frozenset())  # forgotten
        assert registry.get_model_version(4) is None
    finally:
        registry.close()


async def _write_turns(client: aredis.Redis, version: int, scores: list[float]) -> None:
    async with client.pipeline(transaction=False) as pipe:
        for score in scores:
            QualityStore.queue_turn(pipe, version, score, "a reply of a few words")
        await pipe.execute()


def _weights(path: str) -> dict[str, object]:
    [file] = Path(path).glob("*.safetensors")
    return dict(load_file(file))


@pytest.mark.parametrize("published", ["weights", "adapter"])
async def test_a_version_that_served_badly_is_rolled_back_to_the_last_good_one(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path, published: str
) -> None:
    """End to end: served counters -> the trainer's watch -> a new version with good weights
    (full weights, or, with LoRA, the adapter: the other adapters' and the base untouched)."""
    writer = BatchWriter(aredis_client, data_dir)
    for seed in (31, 32):
        await writer.write(make_samples(4, seed=seed), 0)
    trainer_cfg: dict[str, object] = {
        "lr": 1e-3,
        "gate": {"enabled": False},
        "watch": {"min_turns": 8, "check_interval_s": 0.05},
    }
    if published == "adapter":
        trainer_cfg |= {"lr": 1e-2, "lora": {"enabled": True, "rank": 4, "alpha": 8}}
    first = trainer_of(settings_for(redis_url, data_dir, trainer={**trainer_cfg, "max_updates": 2}))
    await first.run()
    assert (
        first.version == 2 and first.guards.watch is not None and first.guards.watch.rollbacks == 0
    )

    await _write_turns(aredis_client, 0, [0.5, 1.0] * 4)  # mean 0.75
    await _write_turns(aredis_client, 1, [1.0] * 10)  # better: the one to go back to
    await _write_turns(aredis_client, 2, [-1.0, -0.5] * 5)  # what v2 served was bad
    [v0] = await QualityStore(aredis_client).read([0])
    assert v0.reward_sd == pytest.approx(0.2673, abs=1e-4)  # sample sd of four 0.5s, four 1s

    await writer.write(make_samples(4, seed=33), 2)
    second = trainer_of(
        settings_for(redis_url, data_dir, trainer={**trainer_cfg, "max_updates": 1})
    )
    await second.run()  # resumes from v2; sees v2's turns; rolls back; then trains the batch
    assert second.guards.watch is not None and second.guards.watch.rollbacks == 1
    assert second.metrics.registry.get_sample_value("liveloop_trainer_rollbacks_total") == 1
    assert second.version == 4

    announced = await _announced(aredis_client)
    assert [(a.version, a.parent, a.status) for a in announced] == [
        (1, 0, "accepted"),
        (2, 1, "accepted"),
        (3, 1, "accepted"),  # v1's weights, served again under a new number
        (4, 3, "accepted"),
    ]
    assert announced[2].reason and announced[2].reason.startswith("the weights of v1 again")
    kinds = {a.kind for a in announced}
    assert kinds == ({"adapter"} if published == "adapter" else {"full"})
    paths = {a.version: a.path for a in announced}
    again, good, bad = _weights(paths[3]), _weights(paths[1]), _weights(paths[2])
    assert again.keys() == good.keys()
    assert all(again[k].equal(good[k]) for k in good)  # type: ignore[attr-defined]
    assert not all(again[k].equal(bad[k]) for k in bad)  # type: ignore[attr-defined]

    db_url = settings_for(redis_url, data_dir).effective_db_url
    with Registry.open(db_url) as registry:
        rows = {v.version: v for v in registry.list_model_versions()}
    assert rows[2].status == "rolled_back" and rows[2].reason
    assert "below the last good versions' (v0, v1: +0.889 over 18 turns)" in rows[2].reason
    assert rows[2].reason.endswith("rolled back to v1 as v3")
    assert [rows[v].status for v in (1, 3, 4)] == ["accepted"] * 3
    printed = format_table(quality_rows(db_url))  # what `liveloop eval` prints
    assert f"v2 rolled back: {rows[2].reason}" in printed.splitlines()

"""Paced simulated users: they wait for the trainer, counting judged turns and versions."""

from __future__ import annotations

import asyncio

import pytest
import redis

from liveloop import bus
from liveloop.cli import build_parser, settings_from_args
from liveloop.config import LiveLoopSettings
from liveloop.demo.pacing import Pacer
from liveloop.demo.run import _child_env


def demo_settings(*flags: str, **env: str) -> LiveLoopSettings:
    """The settings `liveloop demo <flags>` runs with: its preset, under flags."""
    return settings_from_args(build_parser().parse_args(["demo", *flags]))


def _add(client: redis.Redis, stream: str, n: int) -> None:
    for i in range(n):
        client.xadd(bus.stream_key(stream), {"data": f"{i}"})


def test_users_wait_once_a_version_has_its_turns_until_the_next_version(redis_url: str) -> None:
    client = bus.redis_client_sync(redis_url)
    try:
        pacer = Pacer(client, per_update=3)
        assert pacer.allowed()
        _add(client, bus.SCORED, 2)
        assert pacer.allowed()
        _add(client, bus.SCORED, 1)
        assert not pacer.allowed()  # version 0 has its 3 turns

        async def publish_later() -> None:
            await asyncio.sleep(0.3)
            await asyncio.to_thread(_add, client, bus.WEIGHTS, 1)

        async def waited() -> float:
            loop = asyncio.get_running_loop()
            start = loop.time()
            await asyncio.gather(pacer.wait(), publish_later())
            return loop.time() - start

        assert asyncio.run(waited()) >= 0.3
        assert pacer.allowed() and pacer.waits == 0
        _add(client, bus.SCORED, 3)
        assert not pacer.allowed()  # versions 0 and 1 have 3 turns each
    finally:
        client.close()


def test_a_wait_that_no_version_ends_gives_up_and_is_counted(redis_url: str) -> None:
    client = bus.redis_client_sync(redis_url)
    try:
        pacer = Pacer(client, per_update=1, max_wait_s=0.2)
        _add(client, bus.SCORED, 1)
        asyncio.run(pacer.wait())
        assert pacer.waits == 1
    finally:
        client.close()


def test_smollm2_demo_users_are_paced_by_default_and_a_batch_ships_at_one_versions_turns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    smollm2 = demo_settings("--model", "smollm2-135m")
    assert smollm2.demo.turns_per_update == 24
    assert _child_env(smollm2, "key", 24)["LIVELOOP_COLLECTOR__MIN_TURNS"] == "24"
    assert demo_settings("--model", "tiny-random").demo.turns_per_update == 64
    other = demo_settings("--model", "some/other-model")  # smollm2's preset, another model
    assert other.demo.turns_per_update == 24 and other.model == "some/other-model"
    monkeypatch.setenv("LIVELOOP_DEMO__TURNS_PER_UPDATE", "0")
    assert demo_settings("--model", "smollm2-135m").demo.turns_per_update == 0
    monkeypatch.setenv("LIVELOOP_DEMO__TURNS_PER_UPDATE", "12")
    asked = demo_settings("--model", "tiny-random")
    assert asked.demo.turns_per_update == 12
    assert "LIVELOOP_COLLECTOR__MIN_TURNS" not in _child_env(asked, "key", 0)  # not paced
    assert asked.collector.min_turns == 16  # the preset's batch size


def test_users_go_on_while_the_trainer_has_no_batch_left(redis_url: str) -> None:
    """A batch the trainer drops whole makes no version: once the trainer's group has read
    and acknowledged every batch, users are let through; while one waits, they are held."""
    client = bus.redis_client_sync(redis_url)
    batches = bus.stream_key(bus.BATCHES)
    try:
        pacer = Pacer(client, per_update=2)
        _add(client, bus.SCORED, 2)
        assert not pacer.allowed()  # no batch yet: the trainer has nothing to be idle about
        entry_id = client.xadd(batches, {"data": "b"})
        client.xgroup_create(batches, bus.TRAINER_GROUP, id="0")
        assert not pacer.allowed()  # written, not read
        client.xreadgroup(bus.TRAINER_GROUP, "t", {batches: ">"}, count=1)
        assert not pacer.allowed()  # read, not acknowledged
        client.xack(batches, bus.TRAINER_GROUP, entry_id)
        assert pacer.allowed()  # dropped whole, no version: the users go on
        _add(client, bus.BATCHES, 1)
        assert not pacer.allowed()  # the next batch waits for the trainer
    finally:
        client.close()

"""WeightFollower and checkpoint loading against the real TorchEngine on tiny-random and a real Valkey."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aredis
import torch
from prometheus_client import CollectorRegistry
from safetensors.torch import save_file

from liveloop import bus
from liveloop.contracts import WeightsAnnouncement
from liveloop.models import LoadedModel, load_model
from liveloop.server.engine import SamplingParams, TokenOutput, TorchEngine
from liveloop.server.traces import WeightFollower
from liveloop.valkey import EmbeddedValkey
from liveloop.weights import CheckpointError, load_checkpoint_state_dict
from tests.conftest import wait_for

PROMPT = [1, 504, 3458, 28, 2]


@pytest.fixture
def tiny() -> LoadedModel:
    return load_model("tiny-random")


@pytest.fixture
async def engine(tiny: LoadedModel) -> AsyncIterator[TorchEngine]:
    eng = TorchEngine(tiny.model, tiny.tokenizer, max_batch_size=4)
    await eng.start()
    yield eng
    await eng.stop()


def perturbed_checkpoint(
    model: torch.nn.Module, directory: Path, seed: int, **save: object
) -> dict[str, torch.Tensor]:
    """save_pretrained a noisy copy of `model` into `directory`; its state dict."""
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in twin.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    twin.save_pretrained(directory, **save)  # type: ignore[operator]
    return {k: v.clone() for k, v in twin.state_dict().items()}


def swaps(registry: CollectorRegistry, outcome: str) -> float:
    return registry.get_sample_value("liveloop_weight_swaps_total", {"outcome": outcome}) or 0.0


async def announce(client: aredis.Redis, version: int, path: Path) -> str | None:
    announcement = WeightsAnnouncement(version=version, path=str(path))
    return await bus.publish(client, bus.WEIGHTS, announcement)


async def generate(engine: TorchEngine, max_tokens: int) -> list[TokenOutput]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [out async for out in engine.generate(PROMPT, params)]


def weights_equal(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> bool:
    state = model.state_dict()
    return all(torch.equal(state[name], tensor) for name, tensor in expected.items())


async def test_announced_checkpoint_swaps_in_during_a_generation(
    tiny: LoadedModel,
    engine: TorchEngine,
    redis_url: str,
    aredis_client: aredis.Redis,
    tmp_path: Path,
) -> None:
    expected = perturbed_checkpoint(tiny.model, tmp_path / "v1", seed=1)
    registry = CollectorRegistry()
    follower = WeightFollower(engine, redis_url, registry, block_ms=200)
    await follower.start()
    await wait_for(lambda: follower.connected)

    params = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)
    stream = engine.generate(PROMPT, params)
    outputs = [await anext(stream)]  # the request is decoding before the announcement
    await announce(aredis_client, 1, tmp_path / "v1")
    outputs += [out async for out in stream]
    await follower.stop()

    versions = [out.version for out in outputs]
    assert len(outputs) == 600 and outputs[-1].finish_reason == "length"
    assert versions[0] == 0 and versions[-1] == 1
    assert versions == sorted(versions)  # switched once, between two steps
    assert engine.version == follower.current_version == 1
    assert weights_equal(tiny.model, expected)
    assert [h["version"] for h in follower.history] == [1]
    assert follower.history[0]["path"] == str(tmp_path / "v1")
    assert follower.history[0]["pause_s"] >= 0
    assert swaps(registry, "ok") == 1 and swaps(registry, "refused") == 0
    assert registry.get_sample_value("liveloop_weight_swap_pause_seconds_count") == 1
    assert {out.version for out in await generate(engine, 5)} == {1}  # new requests


async def test_restarted_follower_picks_the_newest_announcement_and_skips_old_ones(
    tiny: LoadedModel,
    engine: TorchEngine,
    redis_url: str,
    aredis_client: aredis.Redis,
    tmp_path: Path,
) -> None:
    perturbed_checkpoint(tiny.model, tmp_path / "v1", seed=1)
    newest = perturbed_checkpoint(tiny.model, tmp_path / "v2", seed=2)
    await announce(aredis_client, 1, tmp_path / "v1")
    await announce(aredis_client, 2, tmp_path / "v2")  # both before the server (re)started
    registry = CollectorRegistry()
    follower = WeightFollower(engine, redis_url, registry, block_ms=200)
    await follower.start()
    await wait_for(lambda: engine.version == 2)
    assert weights_equal(tiny.model, newest)
    await announce(aredis_client, 1, tmp_path / "v1")  # stale: must be skipped
    last = await announce(aredis_client, 2, tmp_path / "missing")  # same version: no load
    await wait_for(lambda: follower.cursor == last)  # both were read (and considered)
    await follower.stop()
    assert engine.version == 2 and weights_equal(tiny.model, newest)
    assert swaps(registry, "ok") == 1 and swaps(registry, "refused") == 0


async def test_bad_announcement_is_refused_and_serving_goes_on(
    tiny: LoadedModel,
    engine: TorchEngine,
    redis_url: str,
    aredis_client: aredis.Redis,
    tmp_path: Path,
) -> None:
    original = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    broken = copy.deepcopy(tiny.model)
    with torch.no_grad():
        broken.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    broken.save_pretrained(tmp_path / "nan")
    good = perturbed_checkpoint(tiny.model, tmp_path / "good", seed=3)
    registry = CollectorRegistry()
    follower = WeightFollower(engine, redis_url, registry, block_ms=200)
    await follower.start()
    await wait_for(lambda: follower.connected)

    await announce(aredis_client, 1, tmp_path / "nan")
    await wait_for(lambda: swaps(registry, "refused") == 1)
    assert engine.version == 0 and weights_equal(tiny.model, original)
    assert "NaN" in follower.refused[-1]["error"]
    assert {out.version for out in await generate(engine, 5)} == {0}  # still serving

    await announce(aredis_client, 2, tmp_path / "good")  # the loop keeps following
    await wait_for(lambda: engine.version == 2)
    await follower.stop()
    assert weights_equal(tiny.model, good)


async def test_load_refuses_bad_checkpoints_and_keeps_the_old_weights(
    tiny: LoadedModel, engine: TorchEngine, tmp_path: Path
) -> None:
    registry = CollectorRegistry()
    follower = WeightFollower(engine, None, registry)
    original = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    state = {k: v.clone() for k, v in original.items() if k != "lm_head.weight"}

    wrong_shape = dict(state)
    wrong_shape["model.norm.weight"] = torch.ones(7)
    save_file(wrong_shape, tmp_path / "shape.safetensors")
    wrong_dtype = dict(state)
    wrong_dtype["model.norm.weight"] = state["model.norm.weight"].half()
    save_file(wrong_dtype, tmp_path / "dtype.safetensors")
    extra = dict(state)
    extra["model.bogus"] = torch.zeros(3)
    save_file(extra, tmp_path / "extra.safetensors")
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    save_file(missing, tmp_path / "missing.safetensors")
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "model.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"
    )
    (tmp_path / "empty").mkdir()

    cases = {
        tmp_path / "nowhere": "not found",
        tmp_path / "empty": r"no \*\.safetensors",
        tmp_path / "garbage": "unreadable safetensors",
        tmp_path / "shape.safetensors": "shape",
        tmp_path / "dtype.safetensors": "dtype",
        tmp_path / "extra.safetensors": "model.bogus",
        tmp_path / "missing.safetensors": "model.norm.weight",
    }
    for path, problem in cases.items():
        with pytest.raises(CheckpointError, match=problem):
            await follower.load(str(path))
    assert swaps(registry, "refused") == len(cases)
    assert [r["path"] for r in follower.refused] == [str(p) for p in cases]
    assert engine.version == 0 and weights_equal(tiny.model, original)
    assert follower.history == []

    save_file(state, tmp_path / "same.safetensors")  # a single file is a checkpoint too
    assert await follower.load(str(tmp_path / "same.safetensors")) == 1
    with pytest.raises(CheckpointError, match="not newer"):
        await follower.load(str(tmp_path / "same.safetensors"), version=1)
    assert await follower.load(str(tmp_path / "same.safetensors"), version=5) == 5
    assert [h["version"] for h in follower.history] == [1, 5]
    assert {out.version for out in await generate(engine, 3)} == {5}


def test_sharded_checkpoint_reads_whole_and_names_a_missing_shard(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    expected = perturbed_checkpoint(tiny.model, tmp_path / "sharded", seed=4, max_shard_size="1MB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    loaded = load_checkpoint_state_dict(tmp_path / "sharded")
    assert set(loaded) == set(index["weight_map"])
    assert all(torch.equal(loaded[k], expected[k]) for k in loaded)

    (tmp_path / "sharded" / shards[-1]).unlink()
    with pytest.raises(CheckpointError, match=shards[-1]):
        load_checkpoint_state_dict(tmp_path / "sharded")


async def test_follower_reconnects_after_redis_restarts(
    tiny: LoadedModel, engine: TorchEngine, tmp_path: Path
) -> None:
    expected = perturbed_checkpoint(tiny.model, tmp_path / "v1", seed=5)
    server = EmbeddedValkey(tmp_path / "own-valkey").start()
    follower = WeightFollower(
        engine, server.url, CollectorRegistry(), block_ms=200, reconnect_initial_s=0.05
    )
    try:
        await follower.start()
        await wait_for(lambda: follower.connected)
        server.stop()
        await wait_for(lambda: not follower.connected)
        server.start()
        client = aredis.from_url(server.url, decode_responses=True)
        await announce(client, 1, tmp_path / "v1")
        await client.aclose()
        await wait_for(lambda: engine.version == 1)
        assert follower.connected and weights_equal(tiny.model, expected)
    finally:
        await follower.stop()
        server.stop()


async def test_stop_returns_promptly_while_following(engine: TorchEngine, redis_url: str) -> None:
    # redis-py on Python 3.11 can swallow a task cancellation during a socket write;
    # stop() must still end the follower within about one blocking read.
    for i in range(10):
        follower = WeightFollower(engine, redis_url, CollectorRegistry(), block_ms=50)
        await follower.start()
        await wait_for(lambda f=follower: f.connected)  # type: ignore[misc]
        await asyncio.sleep(0.013 * i)
        started = time.monotonic()
        await asyncio.wait_for(follower.stop(), timeout=5.0)
        assert time.monotonic() - started < 3.0 and not follower.connected

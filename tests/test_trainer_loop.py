"""The training loop end to end on tiny-random: checkpoints, registry, announcements, resume."""

from __future__ import annotations

from pathlib import Path

import redis.asyncio as aredis
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from liveloop import bus
from liveloop.collector.writer import BatchWriter
from liveloop.config import LiveLoopSettings
from liveloop.config.trainer import TrainerConfig
from liveloop.contracts import WeightsAnnouncement
from liveloop.models import load_model
from liveloop.registry import Registry
from liveloop.trainer.metrics import TrainerMetrics
from liveloop.trainer.objectives import ObjectiveContext, build_objective
from liveloop.trainer.source import trainable_samples
from tests.test_collector_support import settings_for, trainer_of
from tests.test_trainer import make_samples, policy


def settings(redis_url: str, data_dir: Path, **trainer: object) -> LiveLoopSettings:
    cfg = {"lr": 1e-3, "read_block_ms": 100, **trainer}
    return settings_for(redis_url, data_dir, trainer=cfg)


async def announcements(client: aredis.Redis) -> list[WeightsAnnouncement]:
    entries = await client.xrange("liveloop:weights")
    return [bus.decode(f, WeightsAnnouncement) for _id, f in entries]


def base_embedding() -> torch.Tensor:
    return load_model("tiny-random").model.get_input_embeddings().weight.detach()


async def test_publishes_versions_and_resumes_after_restart(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    writer = BatchWriter(aredis_client, data_dir)
    first = make_samples(6, seed=10)
    await writer.write(first[:3], 0)  # inline
    spiller = BatchWriter(aredis_client, data_dir, inline_max_bytes=1024)
    await spiller.write(first[3:], 0)  # by reference: a file under the data dir
    spilled = list((data_dir / "batches").glob("*.json"))
    assert len(spilled) == 1

    # Pruning by keep_checkpoints alone: the served-quality watch would also keep the
    # versions it has yet to check (tests/test_served_watch.py).
    unwatched = {"enabled": False}
    trainer = trainer_of(
        settings(redis_url, data_dir, max_updates=2, keep_checkpoints=2, watch=unwatched)
    )
    await trainer.run()
    assert trainer.version == 2

    ckpt = data_dir / "checkpoints" / "v2"
    loaded = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "tokenizer.json").is_file()
    emb = loaded.get_input_embeddings().weight
    assert torch.equal(emb, trainer.updater.policy.model.get_input_embeddings().weight)
    assert not torch.equal(emb, base_embedding())

    with Registry.open(trainer.shared.effective_db_url) as reg:
        rows = reg.list_model_versions()
    assert [(r.version, r.parent) for r in rows] == [(2, 1), (1, 0)]
    assert rows[0].path == str(ckpt.resolve()) and "loss" in rows[0].metrics
    got = await announcements(aredis_client)
    assert [(a.version, a.parent) for a in got] == [(1, 0), (2, 1)]
    assert got[1].path == str(ckpt.resolve()) and got[1].metrics["samples"] == 3
    assert not spilled[0].exists()  # consumed by-reference batch file removed
    assert (await aredis_client.xpending("liveloop:batches", "trainer"))["pending"] == 0

    # Restart: the first batch comes again (a crash before its ack) plus a new one.
    saved_state = trainer.updater.optimizer.state_dict()["state"]
    [(_id, fields)] = await aredis_client.xrange("liveloop:batches", count=1)
    await aredis_client.xadd("liveloop:batches", fields)
    await writer.write(make_samples(2, seed=11), 2)

    again = trainer_of(
        settings(redis_url, data_dir, max_updates=1, keep_checkpoints=2, watch=unwatched)
    )
    again.setup()
    assert again.version == 2
    resumed = again.updater.optimizer.state_dict()["state"]
    assert resumed.keys() == saved_state.keys()
    for k, v in saved_state.items():
        assert torch.equal(resumed[k]["exp_avg_sq"], v["exp_avg_sq"])
        assert resumed[k]["step"] == v["step"]
    again.updater = None
    await again.run()
    assert again.version == 3 and again.updates_done == 1
    assert again.metrics.dropped.labels("duplicate_batch")._value.get() == 3  # its samples
    assert sorted(p.name for p in (data_dir / "checkpoints").glob("v*")) == ["v2", "v3"]
    with Registry.open(again.shared.effective_db_url) as reg:
        assert [r.version for r in reg.list_model_versions()] == [3, 2]
    assert [a.version for a in await announcements(aredis_client)] == [1, 2, 3]


async def test_lora_checkpoints_hold_merged_weights_and_resume_the_adapter(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    writer = BatchWriter(aredis_client, data_dir)
    await writer.write(make_samples(4, seed=12), 0)
    lora = {"enabled": True, "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    s = settings(redis_url, data_dir, max_updates=1, lora=lora, lr=1e-2, publish="merged")
    trainer = trainer_of(s)
    await trainer.run()
    ckpt = data_dir / "checkpoints" / "v1"
    tensors = load_file(str(ckpt / "model.safetensors"))
    assert not any("lora" in name for name in tensors)
    merged = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    base = load_model("tiny-random").model
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[q], base.state_dict()[q])
    assert torch.equal(
        merged.state_dict()["model.norm.weight"], base.state_dict()["model.norm.weight"]
    )

    again = trainer_of(s)
    again.setup()
    assert again.version == 1 and again.updater is not None
    before = {k: v for k, v in trainer.updater.policy.model.state_dict().items() if "lora_" in k}
    after = {k: v for k, v in again.updater.policy.model.state_dict().items() if "lora_" in k}
    assert before.keys() == after.keys() and before
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_trainer_applies_the_staleness_bound_again() -> None:
    samples = make_samples(3, seed=13)
    for sample, oldest in zip(samples, (3, 2, 1), strict=True):
        sample.versions = [oldest] + [3] * (len(sample.versions) - 1)
    metrics = TrainerMetrics()
    # batches queued while the trainer moved on to version 3; one version of staleness allowed
    pol = policy()
    rl, opd = (
        build_objective(ObjectiveContext(pol, TrainerConfig(objective=name), "tiny-random"))  # type: ignore[arg-type]
        for name in ("rl", "opd")
    )
    kept = trainable_samples(samples, 3, rl, 1, metrics)
    assert [x.key for x in kept] == [samples[0].key, samples[1].key]
    assert metrics.dropped.labels("stale")._value.get() == 1
    assert trainable_samples(samples, 3, opd, 1, TrainerMetrics()) == []  # no hints


async def test_lora_versions_published_as_adapters_are_validated_announced_and_resumed(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    """With LoRA, a version is the adapter alone (the PEFT layout), validated, announced as
    an adapter under its name, and resumed from (rollbacks: tests/test_served_watch.py)."""
    from liveloop.weights import SharedDiskTransport
    from liveloop.weights.adapter import read_adapter

    writer = BatchWriter(aredis_client, data_dir)
    for seed in (14, 15):
        await writer.write(make_samples(4, seed=seed), 0)
    lora = {"enabled": True, "rank": 4, "alpha": 8, "adapter_name": "house-style"}
    s = settings(redis_url, data_dir, max_updates=2, lora=lora, lr=1e-2)
    trainer = trainer_of(s)
    await trainer.run()
    ckpt = data_dir / "checkpoints" / "v2"
    assert (ckpt / "adapter_config.json").is_file() and (
        ckpt / "adapter_model.safetensors"
    ).is_file()
    assert not (ckpt / "model.safetensors").exists()  # the base weights never travel
    base = load_model("tiny-random").model
    shapes = {k: tuple(v.shape) for k, v in base.state_dict().items()}
    adapter = read_adapter(ckpt, shapes)  # names and shapes fit the base, finite
    assert len(adapter.modules) == 2 * 7  # every linear of the two layers
    SharedDiskTransport().validate(str(ckpt))
    got = await announcements(aredis_client)
    assert [(a.version, a.kind, a.adapter) for a in got] == [
        (1, "adapter", "house-style"),
        (2, "adapter", "house-style"),
    ]

    again = trainer_of(s)
    again.setup()  # resumes from the adapter the version is
    before = {k: v for k, v in trainer.updater.policy.model.state_dict().items() if "lora_" in k}
    after = {k: v for k, v in again.updater.policy.model.state_dict().items() if "lora_" in k}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


async def test_a_batch_with_too_few_samples_left_makes_no_update(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    """`min_update_samples` counts what is left after flat samples are dropped: a batch of
    five whose three are flat keeps two, fewer than three, so it is acknowledged without an
    update (counted `too_few`); the next batch, four informative samples, is trained."""
    writer = BatchWriter(aredis_client, data_dir)
    mostly_flat = make_samples(5, seed=20)
    for sample in mostly_flat[:3]:
        sample.advantage = 0.0
    await writer.write(mostly_flat, 0)
    await writer.write(make_samples(4, seed=21), 0)
    trainer = trainer_of(
        settings(redis_url, data_dir, max_updates=1, min_update_samples=3,
                 skip_flat_samples=True, gate={"enabled": False}, watch={"enabled": False})
    )  # fmt: skip
    await trainer.run()
    assert trainer.version == 1 and trainer.updates_done == 1
    assert trainer.last_stats is not None and trainer.last_stats.samples == 4
    assert trainer.metrics.dropped.labels("flat")._value.get() == 3
    assert trainer.metrics.dropped.labels("too_few")._value.get() == 2
    assert [a.metrics["samples"] for a in await announcements(aredis_client)] == [4]
    assert (await aredis_client.xpending("liveloop:batches", "trainer"))["pending"] == 0

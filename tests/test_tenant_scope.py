"""Tenant scope (`trainer.scope = "tenant"`) against a real Valkey, on tiny-random: the
collector packs one tenant's turns per batch with staleness counted in that tenant's own
versions; the trainer keeps one adapter, optimizer state and version history per tenant
(also through a lane going cold and read back), gates each with its own tenant's prompts,
and publishes each version as the adapter named after its tenant."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import redis.asyncio as aredis
import torch

from liveloop import bus
from liveloop.cli import main
from liveloop.collector.loop import Collector
from liveloop.collector.writer import BatchWriter
from liveloop.config import ConfigError, load_settings
from liveloop.contracts import TrainingBatch, TurnRecord, WeightsAnnouncement
from liveloop.evaluation import quality_rows
from liveloop.registry import Registry
from liveloop.tenants import tenant_lag
from liveloop.trainer.tenants import TenantTrainer
from tests.test_collector_support import publish_turns, scored_turn, settings_for
from tests.test_trainer import make_samples

FAST = {"group_wait_s": 0.0, "min_turns": 1, "max_wait_s": 0.05, "max_queued_batches": None}
LORA = {"enabled": True, "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


async def batches(client: aredis.Redis) -> list[TrainingBatch]:
    return [bus.decode(f, TrainingBatch) for _id, f in await client.xrange("liveloop:batches")]


async def announce_for(client: aredis.Redis, version: int, tenant: str) -> None:
    ann = WeightsAnnouncement(version=version, path=f"/nowhere/v{version}", kind="adapter",
                              adapter=tenant, tenant=tenant)  # fmt: skip
    await bus.publish(client, bus.WEIGHTS, ann)


def test_tenant_scope_needs_lora_adapters_and_an_engine_that_serves_them() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.lora\.enabled"):
        load_settings(trainer={"scope": "tenant"})
    with pytest.raises(ConfigError, match=r"trainer\.publish"):
        load_settings(trainer={"scope": "tenant", "lora": LORA, "publish": "merged"})
    sglang = {"engine": "sglang", "sglang": {"urls": ["http://127.0.0.1:1"]}}
    with pytest.raises(ConfigError, match=r"server\.sglang\.enable_lora"):
        load_settings(trainer={"scope": "tenant", "lora": LORA}, server=sglang)
    lora_sglang = {**sglang, "sglang": {**sglang["sglang"], "enable_lora": True}}
    assert load_settings(trainer={"scope": "tenant", "lora": LORA}, server=lora_sglang)


def test_tenant_lag_counts_the_tenants_own_updates() -> None:
    assert tenant_lag(0, []) == 0
    assert tenant_lag(0, [3, 7, 9]) == 3  # served by the base: every update since
    assert tenant_lag(7, [3, 7, 9]) == 1
    assert tenant_lag(9, [3, 7, 9]) == 0


async def test_collector_batches_hold_one_tenant_and_count_its_own_staleness(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    # Tenant a's adapter went through versions 4 and 6; b has none (served by the base).
    await announce_for(aredis_client, 4, "ta")
    await announce_for(aredis_client, 6, "ta")
    await bus.publish(aredis_client, bus.WEIGHTS, WeightsAnnouncement(version=9, path="/x"))

    def turn(session: str, tenant: str, versions: list[int]) -> object:
        return scored_turn(session, versions=versions).model_copy(update={"tenant": tenant})

    turns = [
        turn("a-fresh", "ta", [6, 6]),  # 0 of a's updates behind
        turn("a-edge", "ta", [4, 6]),  # 1 behind (6)
        turn("a-old", "ta", [0, 0]),  # 2 behind (4 and 6): dropped
        turn("b-1", "tb", [0, 0]),  # b has no versions: on time, though 9 versions exist
        turn("b-2", "tb", [0]),
    ]
    await publish_turns(aredis_client, turns)  # type: ignore[arg-type]
    s = settings_for(redis_url, data_dir, max_staleness=1, collector=FAST,
                     trainer={"scope": "tenant", "lora": LORA})  # fmt: skip
    collector = Collector(s.shared(), s.collector, aredis_client, tenant_scope=True)
    await collector.start()
    for _ in range(3):
        await collector.step(block_ms=20)
        await asyncio.sleep(0.06)
    got = await batches(aredis_client)
    by_tenant = {b.tenant: sorted(x.key.split(":")[0] for x in b.samples or []) for b in got}
    assert by_tenant == {"ta": ["a-edge", "a-fresh"], "tb": ["b-1", "b-2"]}
    assert len(got) == 2  # one tenant per batch, never mixed
    assert collector.metrics.dropped.labels("stale")._value.get() == 1
    fields = [f for _id, f in await aredis_client.xrange("liveloop:batches")]
    assert sorted(f["tenant"] for f in fields) == ["ta", "tb"]
    # Each tenant's advantages are measured against its own reward baseline.
    stored = await aredis_client.hgetall("liveloop:collector:baselines")
    assert sorted(stored) == ["ta#tenant:rules", "tb#tenant:rules"]
    again = Collector(s.shared(), s.collector, aredis_client, tenant_scope=True)
    await again.start()  # a restarted collector reads them back
    assert again.tenant_baselines["ta"].get("rules").count == 2


async def served_turn(client: aredis.Redis, tenant: str, text: str) -> None:
    record = TurnRecord(
        session_id=f"s-{text}", turn_index=0, tenant=tenant, request_id=f"r-{text}",
        messages=[{"role": "user", "content": text}], prompt_token_ids=[1, 2],
        completion_token_ids=[3], logprobs=[-1.0], versions=[0], finish_reason="stop",
        model="tiny-random",
    )  # fmt: skip
    await bus.publish(client, bus.TURNS, record)


def optimizer_steps(checkpoint: Path) -> set[int]:
    state = torch.load(checkpoint / "trainer_state" / "optimizer.pt", weights_only=True)
    return {int(s["step"]) for s in state["state"].values()}


async def test_trainer_keeps_one_adapter_per_tenant_gated_with_its_own_prompts(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for tenant, texts in (("ta", ["alpha one", "alpha two"]), ("tb", ["beta one"])):
        for text in texts:
            await served_turn(aredis_client, tenant, text)
    writer = BatchWriter(aredis_client, data_dir)
    await writer.write(make_samples(3, seed=30), 0, tenant="ta")
    await writer.write(make_samples(3, seed=31), 0)  # no tenant: not trained in tenant scope
    await writer.write(make_samples(3, seed=32), 0, tenant="tb")
    await writer.write(make_samples(3, seed=33), 0, tenant="ta")
    gate = {"probe_source": "served", "max_tokens": 3, "on_reject": "continue"}
    trainer_cfg = {"scope": "tenant", "lora": LORA, "lr": 1e-2, "read_block_ms": 100,
                   "max_updates": 3, "max_warm_tenants": 1, "gate": gate,
                   "watch": {"enabled": False}}  # fmt: skip
    s = settings_for(redis_url, data_dir, trainer=trainer_cfg)
    trainer = TenantTrainer(s.shared(), s.trainer, judging=s.prm)
    await trainer.run()

    entries = await aredis_client.xrange("liveloop:weights")
    got = [bus.decode(f, WeightsAnnouncement) for _id, f in entries]
    assert [(a.version, a.adapter, a.tenant, a.parent) for a in got] == [
        (1, "ta", "ta", 0),
        (2, "tb", "tb", 0),  # b starts from a fresh adapter, not from a's
        (3, "ta", "ta", 1),  # a goes on from its own v1 (read back from disk: 1 warm lane)
    ]
    assert all(a.kind == "adapter" for a in got)
    root = data_dir / "checkpoints" / "tenants"
    assert sorted(p.name for p in (root / "ta").glob("v*")) == ["v1", "v3"]
    assert sorted(p.name for p in (root / "tb").glob("v*")) == ["v2"]
    assert optimizer_steps(root / "ta" / "v3") == {2}  # its own optimizer state, resumed
    assert optimizer_steps(root / "tb" / "v2") == {1}
    assert trainer.metrics.dropped.labels("no_tenant")._value.get() == 3

    # Each tenant's gate drew its probes from that tenant's served prompts only.
    def probed(tenant: str) -> set[str]:
        gate_of = trainer.lanes[tenant].guards.gate
        assert gate_of is not None
        return {p.messages[-1]["content"] for p in gate_of.probes}

    assert probed("ta") == {"alpha one", "alpha two"} and probed("tb") == {"beta one"}
    # ... and keeps its prompts' reference keys and values while its tenant is warm only
    kept = {t: lane.guards.gate.reference_prompts for t, lane in trainer.lanes.items()
            if lane.guards.gate is not None}  # fmt: skip
    assert len(kept["ta"].entries) == 2 and kept["tb"].entries == {} and kept["tb"].encoded

    with Registry.open(s.shared().effective_db_url) as reg:
        assert [v.version for v in reg.list_model_versions(tenant="ta")] == [3, 1]
        assert [v.version for v in reg.list_model_versions(tenant="tb")] == [2]

    # `liveloop eval --tenant` shows one tenant's versions (and the base beside them).
    capsys.readouterr()
    assert main(["eval", "--data-dir", str(data_dir), "--tenant", "tb", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["tenant"] == "tb" and [r["version"] for r in shown["versions"]] == [0, 2]
    assert main(["eval", "--data-dir", str(data_dir), "--tenant", "nobody"]) == 0
    assert "no policy versions recorded for tenant nobody" in capsys.readouterr().out

    # Tenant a deleted (its checkpoints gone): its adapter leaves the trainer's memory too.
    assert trainer.lane is trainer.lanes["ta"]  # trained last: in the model now
    shutil.rmtree(root / "ta")
    trainer._forget_deleted()
    assert sorted(trainer.lanes) == ["tb"] and trainer.lane is None
    model = trainer.updater.policy.model  # type: ignore[union-attr]
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all(torch.equal(trained[n], trainer._fresh[n]) for n in trained)

    # A restarted trainer finds both tenants on disk and numbers on from the highest.
    again = TenantTrainer(s.shared(), s.trainer, judging=s.prm)
    again.setup()
    assert sorted(again.lanes) == ["tb"] and again.next_version == 3
    assert again.lanes["tb"].versions == [2]


async def test_one_tenants_refusals_never_touch_another_tenants_adapter(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    """Any drift is refused (max_kl 1e-9) where the gate has probes: tenant a has served
    prompts, tenant b none yet (its gate has nothing to compare, and serves)."""
    from peft.utils import load_peft_weights

    await served_turn(aredis_client, "ta", "alpha asks")
    writer = BatchWriter(aredis_client, data_dir)
    for seed, tenant in ((40, "ta"), (41, "tb"), (42, "ta")):
        await writer.write(make_samples(3, seed=seed), 0, tenant=tenant)
    gate = {"probe_source": "served", "max_tokens": 3, "max_kl": 1e-9, "on_reject": "revert"}
    trainer_cfg = {"scope": "tenant", "lora": LORA, "lr": 1e-2, "read_block_ms": 100,
                   "max_updates": 3, "gate": gate, "watch": {"enabled": False}}  # fmt: skip
    s = settings_for(redis_url, data_dir, trainer=trainer_cfg)
    trainer = TenantTrainer(s.shared(), s.trainer, judging=s.prm)
    await trainer.run()

    entries = await aredis_client.xrange("liveloop:weights")
    got = [bus.decode(f, WeightsAnnouncement) for _id, f in entries]
    assert [(a.version, a.tenant, a.status, a.parent) for a in got] == [
        (1, "ta", "rejected", 0),
        (2, "tb", "accepted", 0),
        (3, "ta", "rejected", 0),  # a went back to its base, not to b's adapter
    ]
    ta, tb = trainer.lanes["ta"], trainer.lanes["tb"]
    assert trainer.state.version == 0 and trainer.lr_scale < 1.0  # a is being trained
    assert tb.state.version == 2 and tb.lr_scale == 1.0  # b's own state, untouched
    assert tb.warm is not None  # b's adapter, kept in memory, is still the one it served
    saved = load_peft_weights(str(data_dir / "checkpoints" / "tenants" / "tb" / "v2"), "cpu")
    kept = {k.replace(".default", ""): v for k, v in tb.warm.adapter.items()}
    assert saved.keys() == kept.keys()
    assert all(torch.equal(saved[k], kept[k]) for k in saved)
    assert ta.guards.rejected == 2 and tb.guards.rejected == 0
    # Operators see it per tenant (bounded labels, liveloop.trainer.tenant_metrics).
    sample = trainer.metrics.registry.get_sample_value
    assert sample("liveloop_tenant_refusals_total", {"tenant": "ta"}) == 2
    assert sample("liveloop_tenant_refusals_total", {"tenant": "tb"}) == 0
    assert sample("liveloop_tenant_rollbacks_total", {"tenant": "ta"}) == 0
    assert sample("liveloop_tenant_version", {"tenant": "tb"}) == 2
    assert sample("liveloop_tenant_updates_total", {"tenant": "ta"}) == 2
    assert sample("liveloop_tenant_reward", {"tenant": "tb"}) is not None


def test_tenant_metrics_name_only_the_busiest_tenants() -> None:
    from prometheus_client import CollectorRegistry

    from liveloop.trainer.tenant_metrics import TenantMetrics

    registry = CollectorRegistry()
    metrics = TenantMetrics(registry, limit=2)
    for tenant, samples in (("a", 20), ("b", 10), ("c", 1)):
        metrics.trained(tenant, 1, 0.5, samples, refused=False)
    assert registry.get_sample_value("liveloop_tenant_updates_total", {"tenant": "other"}) == 1
    assert registry.get_sample_value("liveloop_tenant_version", {"tenant": "other"}) is None
    metrics.trained("c", 2, 0.5, 100, refused=False)  # c grows busier than b: b's series go
    assert registry.get_sample_value("liveloop_tenant_version", {"tenant": "c"}) == 2
    assert registry.get_sample_value("liveloop_tenant_version", {"tenant": "b"}) is None
    metrics.rolled_back("a", 3)
    assert registry.get_sample_value("liveloop_tenant_rollbacks_total", {"tenant": "a"}) == 1


async def test_a_tenants_bad_version_is_rolled_back_alone(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    """Served counters -> tenant a's watch (set up at start-up, before any batch of a) -> a's
    good adapter again under a new version; tenant b trains on from its own."""
    from liveloop.quality import QualityStore

    writer = BatchWriter(aredis_client, data_dir)
    for seed, tenant in ((50, "ta"), (51, "tb"), (52, "ta")):
        await writer.write(make_samples(4, seed=seed), 0, tenant=tenant)
    trainer_cfg = {"scope": "tenant", "lora": LORA, "lr": 1e-2, "read_block_ms": 100,
                   "gate": {"enabled": False},
                   "watch": {"min_turns": 8, "check_interval_s": 0.05}}  # fmt: skip
    s = settings_for(redis_url, data_dir, trainer={**trainer_cfg, "max_updates": 3})
    await TenantTrainer(s.shared(), s.trainer, judging=s.prm).run()  # a: v1, v3; b: v2

    async with aredis_client.pipeline(transaction=False) as pipe:
        for version, scores in ((0, [0.5, 1.0] * 4), (1, [1.0] * 10), (3, [-1.0, -0.5] * 5)):
            for score in scores:
                QualityStore.queue_turn(pipe, version, score, "a reply of a few words", "ta")
        await pipe.execute()
    await writer.write(make_samples(4, seed=53), 0, tenant="tb")
    s = settings_for(redis_url, data_dir, trainer={**trainer_cfg, "max_updates": 1})
    second = TenantTrainer(s.shared(), s.trainer, judging=s.prm)
    await second.run()  # a's watch rolls v3 back to v1 as v4; then b's batch: v5 from v2

    entries = await aredis_client.xrange("liveloop:weights")
    got = [bus.decode(f, WeightsAnnouncement) for _id, f in entries]
    assert [(a.version, a.tenant, a.parent) for a in got][3:] == [
        (4, "ta", 1),  # v1's weights again
        (5, "tb", 2),  # b goes on from its own version, untouched by a's rollback
    ]
    assert got[3].reason is not None and got[3].reason.startswith("the weights of v1 again")
    root = data_dir / "checkpoints" / "tenants" / "ta"
    again = load_peft_weights_of(root / "v4")
    good = load_peft_weights_of(root / "v1")
    assert all(torch.equal(again[k], good[k]) for k in good)
    with Registry.open(s.shared().effective_db_url) as reg:
        assert reg.get_model_version(3).status == "rolled_back"  # type: ignore[union-attr]
    sample = second.metrics.registry.get_sample_value
    assert sample("liveloop_tenant_rollbacks_total", {"tenant": "ta"}) == 1
    assert second.lanes["tb"].guards.watch is not None
    assert second.lanes["tb"].guards.watch.rollbacks == 0


async def test_a_tenants_adapter_is_watched_against_the_base_on_its_own_turns(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    """Tenant a's users score every reply -1, the base's and its adapter's alike; the base
    pleases tenant b's users. a's adapter served no worse than the base did for a: it is
    judged good, not rolled back against the base's turns of every tenant taken together."""
    from liveloop.quality import QualityStore

    writer = BatchWriter(aredis_client, data_dir)
    await writer.write(make_samples(4, seed=60), 0, tenant="ta")
    trainer_cfg = {"scope": "tenant", "lora": LORA, "lr": 1e-2, "read_block_ms": 100,
                   "gate": {"enabled": False},
                   "watch": {"min_turns": 8, "check_interval_s": 0.05}}  # fmt: skip
    s = settings_for(redis_url, data_dir, trainer={**trainer_cfg, "max_updates": 1})
    await TenantTrainer(s.shared(), s.trainer, judging=s.prm).run()  # a: v1

    served = (("ta", 0, [-1.0] * 10), ("tb", 0, [0.5, 1.0] * 10), ("ta", 1, [-1.0] * 10))
    async with aredis_client.pipeline(transaction=False) as pipe:
        for tenant, version, scores in served:
            for score in scores:
                QualityStore.queue_turn(pipe, version, score, "a reply of a few words", tenant)
        await pipe.execute()
    [everyone] = await QualityStore(aredis_client).read([0])
    assert everyone.mean_reward is not None and everyone.mean_reward > 0.0  # a's v1 is far below
    await writer.write(make_samples(4, seed=61), 0, tenant="tb")
    s = settings_for(redis_url, data_dir, trainer={**trainer_cfg, "max_updates": 1})
    second = TenantTrainer(s.shared(), s.trainer, judging=s.prm)
    await second.run()  # a's watch looks first; then b's batch: v2

    entries = await aredis_client.xrange("liveloop:weights")
    got = [bus.decode(f, WeightsAnnouncement) for _id, f in entries]
    assert [(a.version, a.tenant) for a in got] == [(1, "ta"), (2, "tb")]  # no rollback
    watch = second.lanes["ta"].guards.watch
    assert watch is not None and watch.rollbacks == 0
    assert [(g.version, g.mean) for g in watch.good] == [(0, -1.0), (1, -1.0)]
    # `liveloop eval --tenant` shows the same: version 0 on a's turns, beside a's adapter.
    db_url = s.shared().effective_db_url
    rows = {row["version"]: row["served"] for row in quality_rows(db_url, "ta")}
    assert sorted(rows) == [0, 1] and rows[0]["judged"] == 10
    assert rows[0]["mean_reward"] == rows[1]["mean_reward"] == -1.0
    assert {row["version"]: row["served"]["mean_reward"] for row in quality_rows(db_url, "tb")
            if row["version"] == 0} == {0: 0.75}  # fmt: skip
    [everyone] = [row["served"] for row in quality_rows(db_url) if row["version"] == 0]
    assert everyone["judged"] == 30 and everyone["mean_reward"] == pytest.approx(1 / 6)


def load_peft_weights_of(path: Path) -> dict[str, torch.Tensor]:
    from peft.utils import load_peft_weights

    return dict(load_peft_weights(str(path), "cpu"))


async def test_the_collector_drops_what_it_holds_of_a_deleted_tenant(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    def turn(session: str, tenant: str) -> object:
        return scored_turn(session, versions=[0]).model_copy(update={"tenant": tenant})

    await publish_turns(aredis_client, [turn("a-1", "ta"), turn("b-1", "tb")])  # type: ignore[list-item]
    held = {**FAST, "min_turns": 2, "max_wait_s": 60.0}  # one turn each: held, not shipped
    s = settings_for(redis_url, data_dir, collector=held, trainer={"scope": "tenant", "lora": LORA})
    collector = Collector(s.shared(), s.collector, aredis_client, tenant_scope=True)
    await collector.start()
    await collector.step(block_ms=20)
    assert sorted(p.turn.tenant for p in collector.ready) == ["ta", "tb"]

    withdrawal = WeightsAnnouncement(version=0, path="", kind="adapter", adapter="ta",
                                     tenant="ta", withdrawn=True, status="rejected")  # fmt: skip
    await bus.publish(aredis_client, bus.WEIGHTS, withdrawal)
    await publish_turns(aredis_client, [turn("b-2", "tb")])  # type: ignore[list-item]
    for _ in range(2):
        await collector.step(block_ms=20)
    got = await batches(aredis_client)
    assert [(b.tenant, len(b.samples or [])) for b in got] == [("tb", 2)]
    assert collector.ready == [] and collector.metrics.dropped.labels("deleted")._value.get() == 1
    assert await collector.consumer.lag() == (0, 0)  # a's turn acknowledged, not pending


async def test_one_tenants_burst_does_not_hold_back_another(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    """Tenant a's eight turns came first, b's two after; room for two batches: one batch of
    each, not two of a (batches of two turns: 64 tokens, 32 a turn)."""

    def turn(session: str, tenant: str) -> object:
        t = scored_turn(session, prompt_len=28, completion_len=4)
        return t.model_copy(update={"tenant": tenant})

    burst = [turn(f"a-{i}", "ta") for i in range(8)]
    await publish_turns(aredis_client, [*burst, turn("b-0", "tb"), turn("b-1", "tb")])  # type: ignore[list-item]
    cfg = {**FAST, "token_budget": 64, "min_turns": 2, "max_queued_batches": 2}
    s = settings_for(redis_url, data_dir, collector=cfg, trainer={"scope": "tenant", "lora": LORA})
    collector = Collector(s.shared(), s.collector, aredis_client, tenant_scope=True)
    await collector.start()
    await collector.step(block_ms=20)
    got = await batches(aredis_client)
    assert [(b.tenant, len(b.samples or [])) for b in got] == [("ta", 2), ("tb", 2)]

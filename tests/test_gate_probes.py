"""Where the promotion gate's probes come from: served traffic (the production default), the
operator's prompts, or a plugin found by name; and a gate whose probe set is drawn again."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import openai
import pytest
import redis.asyncio as aredis
import torch

from liveloop import plugins
from liveloop.config import ConfigError, SharedSettings, load_settings
from liveloop.config.gate import GateSettings
from liveloop.contracts import TurnRecord
from liveloop.demo.gate_probes import HeldOutUsers
from liveloop.probe_sources import Probe, ProbeContext
from liveloop.reading import question_topic
from liveloop.server.api.auth import tenant_id
from liveloop.trainer.policy import load_policy
from liveloop.trainer.safeguards.gate import PromotionGate, build_panel
from liveloop.trainer.safeguards.probing import ProbeReply, summarise
from liveloop.trainer.safeguards.sources import (
    OperatorPrompts,
    ServedPrompts,
    probe_source_class,
)
from tests.conftest import wait_for
from tests.server_proc import API_KEYS, ServerProcess
from tests.synthetic import conversation, make_turn, user, write_turns
from tests.test_collector_support import settings_for, trainer_of

pytest_plugins = ["tests.server_fixtures"]


def test_sources_by_name_and_a_bad_one_stops_the_trainer(tmp_path: Path) -> None:
    assert probe_source_class(GateSettings()) is ServedPrompts  # no prompts: served traffic
    assert probe_source_class(GateSettings(prompts=["Hi?"])) is OperatorPrompts
    assert probe_source_class(GateSettings(probe_source="served", prompts=["Hi?"])) is ServedPrompts
    assert probe_source_class(GateSettings(probe_source="demo")) is HeldOutUsers  # entry point
    settings = settings_for(
        "redis://127.0.0.1:1", tmp_path, trainer={"gate": {"probe_source": "x"}}
    )
    with pytest.raises(ConfigError, match=r"probe_source: unknown source 'x'.*demo"):
        trainer_of(settings)
    unguarded = settings_for("redis://127.0.0.1:1", tmp_path, trainer={
        "gate": {"probe_source": "x", "enabled": False}})  # fmt: skip
    trainer_of(unguarded)  # no gate: its source is never looked up


def test_the_demo_source_is_found_in_a_source_checkout_without_entry_points(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A source checkout on PYTHONPATH has no installed distribution, so no entry points: the
    demo's trainer must still find LiveLoop's own `demo` source (it used to exit at start-up)."""
    monkeypatch.setattr(plugins, "entry_points", lambda group: [])
    assert probe_source_class(GateSettings(probe_source="demo")) is HeldOutUsers
    known = r"\(known: auto, demo, prompts, served\)"
    with pytest.raises(ConfigError, match=rf"unknown source 'x' {known}"):
        probe_source_class(GateSettings(probe_source="x"))


def _texts(probes: list[Probe]) -> set[str]:
    return {p.question for p in probes}


async def test_served_probes_are_recent_main_turns_of_the_tenant_and_no_opted_out_ones(
    liveloop_server: ServerProcess, client: openai.OpenAI, other_client: openai.OpenAI
) -> None:
    """Through the real server: side turns, opted-out requests and another tenant's requests
    are never drawn; the sample is fixed by the seed."""
    mark = uuid.uuid4().hex[:8]

    def ask(api: openai.OpenAI, text: str, **headers: str) -> None:
        api.chat.completions.create(
            model="tiny-random", messages=[{"role": "user", "content": text}], max_tokens=2,
            extra_headers=headers,
        )  # fmt: skip

    mains = [f"{mark} main {i}" for i in range(3)]
    for text in mains:
        ask(client, text)
    ask(client, f"{mark} side", **{"X-Turn-Type": "side"})
    ask(client, f"{mark} opted out", **{"X-LiveLoop-Train": "false"})
    ask(other_client, f"{mark} other tenant")
    redis_url = liveloop_server.redis_url
    async with aredis.Redis.from_url(redis_url) as redis:

        async def recorded() -> set[str]:
            wide = ServedPrompts(_context(redis, served_probes=10_000))
            return {t for t in _texts(await wide.draw()) if t.startswith(mark)}

        found: set[str] = set()

        async def all_in() -> bool:
            found.update(await recorded())
            return {*mains, f"{mark} other tenant"} <= found

        await wait_for(all_in, timeout_s=30, interval_s=0.2, what="the turns recorded")
        assert f"{mark} side" not in found and f"{mark} opted out" not in found
        tenant = tenant_id(API_KEYS[0])
        mine = ServedPrompts(_context(redis, served_probes=10_000, tenant=tenant))
        drawn = {t for t in _texts(await mine.draw()) if t.startswith(mark)}
        assert drawn == set(mains)  # not the other tenant's
        few = ServedPrompts(_context(redis, served_probes=2, tenant=tenant))
        first, again = await few.draw(), await few.draw()
        assert len(first) == 2 and first == again  # a fixed, seeded sample


def _context(redis: aredis.Redis, tenant: str | None = None, **gate: int) -> ProbeContext:
    return ProbeContext(GateSettings(**gate), SharedSettings(model="tiny-random"), redis, tenant)


async def test_a_gate_on_served_probes_has_no_evidence_at_first_then_draws_and_rebaselines(
    aredis_client: aredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A trainer started before any traffic draws no probes; its gate draws again before
    every update until its set is full (not `refresh_versions` later: ten unguarded versions),
    then after every `refresh_versions` candidates. A serving version beyond a bound on a new set is
    looked at again on a second set, and reported if still beyond on both: it stays served,
    and candidates close to it cannot pass; one within the bounds on the first set is not
    looked at on the second."""
    gate_settings = {"refresh_versions": 3, "served_probes": 8, "max_kl": 1e-4}
    settings = load_settings(model="tiny-random", trainer={"gate": gate_settings})
    cfg, shared = settings.trainer.gate, settings.shared()
    source = ServedPrompts(ProbeContext(cfg, shared, aredis_client))
    gate = PromotionGate("tiny-random", cfg, build_panel(settings.prm, shared), source)
    policy = load_policy("tiny-random", "cpu", settings.trainer.lora, with_reference=True)
    await gate.start(policy, 0)
    assert gate.probes == [] and gate.version0 is not None and gate.version0.probes == 0
    verdict = gate.decide(await gate.probe(policy, 1))
    assert verdict.accepted and verdict.reason is not None and "no probes" in verdict.reason

    def served(first: int, last: int) -> list[TurnRecord]:
        return [make_turn(f"s{i}", 0, [user(f"Tell me about thing {i}.")], "ok")
                for i in range(first, last)]  # fmt: skip

    await write_turns(aredis_client, served(0, 5))
    await gate.refresh(policy, 1)  # short (none of 8): drawn again at once
    assert len(gate.probes) == 5 and gate.drawn_at == 1
    assert gate.version0.probes == 5 and gate.serving is not None and gate.serving.version == 1
    assert gate.decide(await gate.probe(policy, 2)).probe.probes == 5
    baseline = gate.version0
    await gate.refresh(policy, 2)  # still short, but no new request: the same set, kept
    assert gate.version0 is baseline
    await write_turns(aredis_client, served(5, 9))
    await gate.refresh(policy, 2)
    assert len(gate.probes) == 8 and gate.version0.probes == 8 and gate.drawn_at == 2
    full = gate.probes
    await write_turns(aredis_client, served(9, 12))
    for version in (3, 4):
        await gate.assess(policy, version)
    await gate.refresh(policy, 40)  # full, two candidates since the draw: kept
    assert gate.probes == full and gate.drawn_at == 2 and gate.assessed == 2
    await gate.assess(policy, 5)  # the third: a refresh is due, whatever the version numbers
    with torch.no_grad():  # the serving weights drift from the reference
        for weight in policy.model.parameters():
            if weight.requires_grad:
                weight.add_(torch.randn_like(weight) * 0.5)
    with caplog.at_level(logging.INFO, logger="liveloop.trainer.safeguards.gate"):
        await gate.refresh(policy, 5)  # a new sample of 12
    # v5 is beyond the KL bound on the new 8: a second set, of the 4 requests left
    assert "v5 is beyond a bound on 8 probes (KL to the reference" in caplog.text
    assert "drew 4 more" in caplog.text
    assert gate.drawn_at == 5 and len(gate.probes) == 8 and gate.probes != full
    assert len(gate.more) == 4 and not {*map(repr, gate.probes)} & {*map(repr, gate.more)}
    assert gate.version0.probes == 8 and gate.serving.version == 5 and gate.serving.probes == 8
    assert gate.version0_both is not None and gate.version0_both.probes == 12
    assert "v5 is itself beyond the gate's bounds on the new probe set" in caplog.text
    with caplog.at_level(logging.INFO, logger="liveloop.trainer.safeguards.gate"):
        close = await gate.assess(policy, 6)  # as far from the reference: both sets, refused
    assert not close.accepted and close.probe.probes == 12 and close.on_first_set.probes == 8
    assert "v6 is beyond a bound on 8 probes" in caplog.text and "looking at 4 more" in caplog.text
    gate.max_kl = None  # now within every bound on the first set: the second is not needed
    gate.cfg = gate.cfg.model_copy(update={"max_nll_ratio": None})
    within = await gate.assess(policy, 7)
    assert within.accepted and within.probe.probes == 8 and within.first is None
    gate.max_kl = cfg.max_kl
    caplog.clear()
    gate.cfg = gate.cfg.model_copy(update={"second_draw": False})
    drawn = gate.probes
    await gate.assess(policy, 8)  # with v6 and v7, the third candidate since the draw
    await gate.refresh(policy, 8)  # due, but the same 8 drawn again: set and baselines stand
    assert gate.probes is drawn and len(gate.more) == 4 and gate.drawn_at == 8
    await write_turns(aredis_client, served(12, 20))
    for version in (9, 10, 11):
        await gate.assess(policy, version)
    with caplog.at_level(logging.INFO, logger="liveloop.trainer.safeguards.gate"):
        await gate.refresh(policy, 11)  # a new draw, no second look
    assert len(gate.probes) == 8 and gate.more == [] and "drew" not in caplog.text
    assert "v11 is itself beyond the gate's bounds" in caplog.text


def test_a_question_names_its_topic_in_its_last_sentence_that_names_anything() -> None:
    assert question_topic("Tell me about glaciers.") == {"glacier", "glaciers", "glacier's"}
    assert question_topic("That's too long. Why do people like the moon?") == {
        "moon", "moons", "moon's"}  # fmt: skip
    assert question_topic("Tell me about bees. Keep it short.") == {"bee", "bee's", "bees"}
    assert question_topic("Describe berries.") == {"berries", "berry", "berry's"}
    assert question_topic("Is it cold in Oslo?") == {
        "cold", "colds", "cold's", "oslo", "osloes", "oslos", "oslo's"}  # fmt: skip
    for question, both in [  # an -es plural: spelling alone cannot tell which "e" goes
        ("Where can I buy shoes?", {"shoe", "shoes"}), ("Explain niches.", {"niche", "niches"}),
        ("Describe boxes.", {"box", "boxes"}), ("Describe glasses.", {"glass", "glasses"}),
        ("Tell me about the potato.", {"potato", "potatoes"}), ("Photo tips?", {"photos"}),
    ]:  # fmt: skip
        topic = question_topic(question)
        assert topic is not None and both <= topic, (question, topic)
    assert question_topic("Why?") is None and question_topic("Hi, please.") is None
    assert question_topic("") is None and question_topic(None) is None


async def test_served_and_operator_probes_carry_their_topic_so_the_gate_reads_it(
    aredis_client: aredis.Redis,
) -> None:
    """A tenant's served probe knows what its question is about (the user's reaction to the
    last reply aside), so the gate's topic rate applies to it: a reply that stops naming the
    topic lowers the rate, in whichever form it names it."""
    turns = conversation(
        "s1",
        [user("Tell me about bread."), user("That's too long. Explain glaciers to me.")],
        ["Bread is baked from flour, water and yeast in many shapes.", "Ice."],
    )
    await write_turns(aredis_client, turns)
    gate = GateSettings(served_probes=100)
    served = await ServedPrompts(
        ProbeContext(gate, SharedSettings(model="tiny-random"), aredis_client)
    ).draw()
    topics = {p.question: p.topic for p in served}
    assert topics == {
        "Tell me about bread.": {"bread", "breads", "bread's"},
        "That's too long. Explain glaciers to me.": {"glacier", "glaciers", "glacier's"},
    }
    prompts = GateSettings(prompts=["Describe bicycles.", "Hi?"])
    operator = await OperatorPrompts(
        ProbeContext(prompts, SharedSettings(model="tiny-random"), None)
    ).draw()
    assert [p.topic for p in operator] == [{"bicycle", "bicycles", "bicycle's"}, None]

    probes = sorted(served, key=lambda p: p.question)
    on_topic = ["Bread is baked from flour.", "Glaciers are rivers of ice that move."]
    drifted = ["Flour and water, baked in an oven.", "A glacier is slow ice."]
    logp = [torch.full((4,), -1.0) for _ in probes]
    rates = []
    for texts in (on_topic, drifted):
        replies = [
            ProbeReply(question=p.question, reply=t) for p, t in zip(probes, texts, strict=True)
        ]
        rates.append(summarise(1, probes, replies, logp, logp).topic_rate)
    assert rates == [1.0, 0.5]

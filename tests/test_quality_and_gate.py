"""Per-version quality on a known reply set, and the promotion gate on degraded weights."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aredis
import torch

from liveloop import bus
from liveloop.collector.writer import BatchWriter
from liveloop.config import LiveLoopSettings, load_settings
from liveloop.contracts import WeightsAnnouncement
from liveloop.demo.gate_probes import HeldOutUsers
from liveloop.probe_sources import Probe, ProbeContext
from liveloop.quality import WORD, DriftSums, QualityStore
from liveloop.registry import Registry
from liveloop.trainer.data import build_micro_batch
from liveloop.trainer.policy import completion_logprobs, load_policy
from liveloop.trainer.ppo import drift_sums
from liveloop.trainer.safeguards.gate import PromotionGate, build_panel
from liveloop.trainer.safeguards.probing import (
    ProbeReply,
    ProbeResult,
    reply_logprobs,
    summarise,
)
from liveloop.trainer.safeguards.sampling import sample_replies
from tests.server_proc import ADMIN_KEY, ServerProcess
from tests.test_collector_support import settings_for, trainer_of
from tests.test_trainer import make_samples


async def test_quality_measures_of_a_known_reply_set(aredis_client: aredis.Redis) -> None:
    store = QualityStore(aredis_client)
    replies = [
        (1.0, "bees make honey"),  # 3 words, bigrams: "bees make", "make honey"
        (-1.0, "bees make wax"),  # bigrams: "bees make" (again), "make wax"
        (None, "owls hoot"),  # unscored; bigram "owls hoot"
    ]
    async with aredis_client.pipeline(transaction=False) as pipe:
        for score, text in replies:
            QualityStore.queue_turn(pipe, 3, score, text)
        QualityStore.queue_turn(pipe, 4, 0.5, "x")
        await pipe.execute()
    await store.add_drift({3: DriftSums(tokens=4, nll_sum=8.0, kl_sum=0.4, replies=2)})
    [v3] = await store.read([3])
    assert (v3.judged, v3.unscored) == (2, 1)
    assert v3.mean_reward == pytest.approx(0.0)
    assert v3.unscored_share == pytest.approx(1 / 3)
    assert v3.mean_reply_words == pytest.approx(8 / 3)
    assert v3.distinct_2 == pytest.approx(4 / 5)  # 4 distinct of 5 bigrams
    assert v3.ref_nll == pytest.approx(2.0) and v3.kl_ref == pytest.approx(0.1)
    assert (v3.ref_tokens, v3.ref_replies) == (4, 2)
    assert [q.version for q in await store.read()] == [3, 4]

    # The base's sums from one tenant's batch: version 0's, and that tenant's alone.
    await store.add_drift({0: DriftSums(tokens=5, nll_sum=10.0, kl_sum=0.5, replies=1)}, "ta")
    await store.add_drift({0: DriftSums(tokens=5, nll_sum=20.0, kl_sum=0.5, replies=1)}, "tb")
    [base_a] = await store.read([0], tenant="ta")
    [base] = await store.read([0])
    assert base_a.ref_nll == pytest.approx(2.0) and base.ref_nll == pytest.approx(3.0)
    [v3_a] = await store.read([3], tenant="ta")  # an adapter's version is its tenant's own
    assert v3_a == v3


def test_drift_sums_split_a_micro_batch_by_served_version() -> None:
    samples = make_samples(2, seed=7)
    samples[0].versions = [5] * len(samples[0].versions)
    samples[1].versions = [6] * len(samples[1].versions)
    mb = build_micro_batch(samples)
    reference = torch.full((mb.num_targets,), -2.0)
    out = drift_sums(mb, reference)
    for sample, version in zip(samples, (5, 6), strict=True):
        n = len(sample.completion_token_ids)
        d = torch.tensor(-2.0) - torch.tensor(sample.logprobs)
        assert (out[version].tokens, out[version].replies) == (n, 1)
        assert out[version].nll_sum == pytest.approx(2.0 * n)
        assert out[version].kl_sum == pytest.approx(float((d.exp() - d - 1).sum()), rel=1e-5)


def _degrade(model: Any) -> None:
    """Noise on every weight, and the final norm scaled up: sharp, unrelated predictions."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(3.0 * p.std() * torch.randn_like(p))
            if name == "model.norm.weight":
                p.mul_(20.0)


def test_probe_replies_carry_the_log_probs_a_full_forward_gives() -> None:
    """The gate takes the candidate's log-probs from `generate`'s logits instead of a second
    pass: left-padded, KV-cached and tempered sampling must still give the untempered
    log-probs that one forward of the packed prompt and reply gives."""
    settings = load_settings(model="tiny-random")
    policy = load_policy("tiny-random", "cpu", settings.trainer.lora)
    prompts = [[5, 9, 11, 30, 2], [7, 8], [40, 41, 42]]
    sampled = sample_replies(
        policy.model, policy.tokenizer, prompts, max_tokens=12, temperature=0.7, seeds=[3, 4, 5]
    )
    full = reply_logprobs(lambda mb: completion_logprobs(policy.model, mb)[0], sampled, "cpu")
    assert [len(x) for x in sampled.logprobs] == [len(c) for c in sampled.completions]
    for own, forward in zip(sampled.logprobs, full, strict=True):
        torch.testing.assert_close(own, forward, atol=1e-4, rtol=1e-4)
    assert any(float(x.min()) < -1.0 for x in full)  # not all near-certain tokens


def test_a_probe_reply_that_calls_an_offered_tool_is_a_call_not_a_non_answer() -> None:
    """A weather tenant's adapter that learned to call its tool must not be refused for
    "no answer" replies: a call (here in the fenced form the 0.5B model writes) to a probe
    offering the tool is counted apart from the answers' measures; offered none, it is no
    answer."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    call = '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Oslo"}\n}\n```'
    probes = [
        Probe.asking("How is the weather in Oslo?", tools=[tool]),
        Probe.asking("Is it cold in Lima today?", tools=[tool]),
        Probe.asking("Tell me about bread.", topic=frozenset({"bread"})),
        Probe.asking("What should I know about the moon?", topic=frozenset({"moon"})),
    ]
    texts = [call, "It is cloudy in Lima.", "Bread is baked from flour and water.", call]
    replies = [ProbeReply(question=p.question, reply=t) for p, t in zip(probes, texts, strict=True)]
    logp = [torch.full((4,), -1.0) for _ in probes]
    result = summarise(3, probes, replies, logp, logp)
    assert result.tool_call_share == 0.5  # one of the two probes offering the tool
    assert result.nonsense_share == pytest.approx(1 / 3)  # the call to the moon question
    assert result.mean_words == pytest.approx((5 + 7 + 7) / 3)
    assert result.topic_rate == 0.5  # bread named, the moon not
    plain = summarise(3, probes[2:3], replies[2:3], logp[:1], logp[:1])
    assert plain.tool_call_share is None and plain.nonsense_share == 0.0


async def test_gate_refuses_noise_scaled_weights_and_accepts_unchanged_ones() -> None:
    settings = load_settings(model="tiny-random", trainer={"gate": {"max_kl": 1.0}})
    policy = load_policy("tiny-random", "cpu", settings.trainer.lora, with_reference=True)
    gate = gate_of(settings)
    await gate.start(policy, 0)
    assert gate.version0 is not None and gate.version0.kl_ref == pytest.approx(0.0, abs=1e-6)
    unchanged = gate.decide(await gate.probe(policy, 1))
    assert unchanged.accepted, unchanged.reason
    assert unchanged.probe.kl_ref == pytest.approx(0.0, abs=1e-4)
    _degrade(policy.model)
    degraded = gate.decide(await gate.probe(policy, 2))
    assert not degraded.accepted
    assert degraded.reason is not None and "KL to the reference" in degraded.reason
    assert degraded.probe.kl_ref > 1.0


def gate_of(settings: LiveLoopSettings) -> PromotionGate:
    """The gate as the trainer builds it, probing with the demo's held-out users."""
    cfg, shared = settings.trainer.gate, settings.shared()
    held_out = HeldOutUsers(ProbeContext(cfg, shared))
    return PromotionGate(settings.model, cfg, build_panel(settings.prm, shared), held_out)


def _probe(
    version: int, reward: float, topic: float, symbols: float = 0.0, nonsense: float = 0.25
) -> ProbeResult:
    return ProbeResult(version=version, probes=16, scored=16, reward=reward, ref_nll=3.0,
                       kl_ref=0.1, mean_words=20.0, distinct_2=0.9, topic_rate=topic,
                       symbol_share=symbols, nonsense_share=nonsense)  # fmt: skip


def test_gate_stops_a_slow_slide_and_replies_that_lose_the_topic() -> None:
    """Each check alone: reward against version 0 too, topic rate, symbols, word salad."""
    settings = load_settings(model="smollm2-135m")
    cfg = settings.trainer.gate  # margin 0.25, topic drop 0.2, symbols 0.1
    gate = gate_of(settings)
    gate.version0, gate.serving = _probe(0, 0.0, 0.75), _probe(4, -0.2, 0.7)
    assert gate.decide(_probe(5, -0.2, 0.7)).accepted  # within the margin of both
    slide = gate.decide(_probe(5, -0.4, 0.7))  # serving - 0.2, but version 0 - 0.4
    assert not slide.accepted and slide.reason is not None
    assert "version 0's" in slide.reason and "serving" not in slide.reason
    off_topic = gate.decide(_probe(5, 0.1, 0.5))  # reward fine, topic 75% -> 50%
    assert not off_topic.accepted and "topic rate" in str(off_topic.reason)
    symbols = gate.decide(_probe(5, 0.1, 0.75, symbols=0.2))
    assert not symbols.accepted and "symbols" in str(symbols.reason)
    assert gate.decide(_probe(5, 0.1, 0.75, nonsense=0.4)).accepted  # 25% -> 40%: within 20 pts
    salad = gate.decide(_probe(5, 0.1, 0.75, nonsense=0.5))  # on topic, but word salad
    assert not salad.accepted and "no answer" in str(salad.reason)
    assert "topic" not in str(salad.reason)
    lenient = cfg.model_copy(
        update={"compare_with_version0": False, "max_topic_drop": None, "max_symbol_share": None,
                "max_nonsense_rise": None}
    )  # fmt: skip
    gate.cfg = lenient
    assert gate.decide(_probe(5, -0.4, 0.5, symbols=0.2, nonsense=1.0)).accepted
    noise = PromotionGate("tiny-random", cfg, gate.panel, gate.source)  # no language: no checks
    noise.version0, noise.serving = gate.version0, gate.serving
    assert noise.decide(_probe(5, -0.2, 0.0, symbols=1.0, nonsense=1.0)).accepted


def test_a_fall_of_exactly_the_bound_is_within_it() -> None:
    """One reply in ten against 10-point bounds: 80% -> 70% on topic (0.8 - 0.7 is a hair
    over 0.1 in floating point) and 30% -> 40% no answers are allowed; one more is not."""
    settings = load_settings(
        model="smollm2-135m",
        trainer={"gate": {"max_topic_drop": 0.1, "max_nonsense_rise": 0.1, "reward_margin": 0.1}},
    )
    gate = gate_of(settings)
    gate.version0, gate.serving = (
        _probe(0, 0.8, 0.8, nonsense=0.3),
        _probe(0, 0.8, 0.8, nonsense=0.3),
    )
    assert gate.decide(_probe(1, 0.7, 0.7, nonsense=0.4)).accepted
    for worse in (_probe(1, 0.6, 0.7, nonsense=0.4), _probe(1, 0.7, 0.6, nonsense=0.4),
                  _probe(1, 0.7, 0.7, nonsense=0.5)):  # fmt: skip
        assert not gate.decide(worse).accepted


def _weights(url: str) -> dict[str, Any]:
    resp = httpx.get(url + "/admin/weights", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


async def _announced(client: aredis.Redis) -> list[WeightsAnnouncement]:
    entries = await client.xrange("liveloop:weights")
    return [bus.decode(fields, WeightsAnnouncement) for _id, fields in entries]


@pytest.mark.slow
async def test_a_refused_version_is_never_served_and_training_goes_on_from_the_last_accepted(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path, tmp_path: Path
) -> None:
    """End to end: trainer -> gate -> registry + liveloop:weights -> a real server process."""
    (tmp_path / "server").mkdir()
    server = ServerProcess(redis_url, tmp_path / "server", env={"LIVELOOP_ADMIN_KEY": ADMIN_KEY})
    server.start()
    try:
        writer = BatchWriter(aredis_client, data_dir)
        await writer.write(make_samples(4, seed=11), 0)
        # tiny-random has no KL bound of its own: its reference is noise
        gate = {"max_kl": 1.0, "probe_source": "demo"}
        wild = settings_for(
            redis_url, data_dir, trainer={"lr": 1.0, "max_updates": 1, "gate": gate}
        )
        trainer = trainer_of(wild)  # Adam at lr 1 moves every weight by ~1: degraded
        await trainer.run()
        assert trainer.version == 0 and trainer.guards.rejected == 1 and trainer.next_version == 2
        base = load_policy("tiny-random", "cpu", wild.trainer.lora).model
        for mine, theirs in zip(trainer._updater().policy.model.parameters(), base.parameters(),
                                strict=True):  # fmt: skip
            assert torch.equal(mine, theirs)  # reverted to version 0's weights
        [refused] = await _announced(aredis_client)
        assert (refused.version, refused.status) == (1, "rejected") and refused.reason

        await writer.write(make_samples(4, seed=12), 0)
        calm = settings_for(
            redis_url, data_dir, trainer={"lr": 1e-9, "max_updates": 1, "gate": gate}
        )
        again = trainer_of(calm)
        await again.run()
        assert again.version == 2 and again.guards.rejected == 0  # numbers are never reused
        assert [(a.version, a.status) for a in await _announced(aredis_client)] == [
            (1, "rejected"),
            (2, "accepted"),
        ]
        with Registry.open(calm.effective_db_url) as registry:
            rows = {v.version: v for v in registry.list_model_versions()}
            assert rows[1].status == "rejected" and rows[1].reason == refused.reason
            assert registry.latest_model_version() == rows[2]
            probes = {q.version: q.probe for q in registry.version_quality()}
        assert probes[1] is not None and probes[1]["kl_ref"] > probes[2]["kl_ref"]
        assert set(probes) >= {0, 1, 2}

        deadline = time.monotonic() + 60
        while (state := _weights(server.base_url))["version"] != 2:
            assert time.monotonic() < deadline, state
            await asyncio.sleep(0.2)
        assert [h["version"] for h in state["history"]] == [2]  # version 1 was never loaded
        assert [r["version"] for r in state["rejected"]] == [1]
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-random", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert raw.headers["x-policy-version"] == "2"
    finally:
        server.stop()


async def test_the_judging_loop_counts_every_finished_turn_per_version(
    aredis_client: aredis.Redis, redis_url: str
) -> None:
    """Judged turns add their score and words to their version; silent ones count unscored.
    Version 0 (the base, serving every tenant without an adapter) is counted per tenant too."""
    from tests.synthetic import conversation, user, write_turns
    from tests.test_prm_loop import fast_settings, judging, wait_for

    settings = fast_settings(redis_url, rules={"timeout_score": None})
    turns = conversation("q", [user("hi"), user("thanks, perfect"), user("too long")])
    other = [
        t.model_copy(update={"tenant": "tenant-other"})
        for t in conversation("r", [user("hi"), user("thanks, perfect")])
    ]
    async with judging(aredis_client, settings):
        await write_turns(aredis_client, [*turns, *other])
        store = QualityStore(aredis_client)

        async def all_finished() -> bool:
            found = await store.read()
            return bool(found) and found[0].judged + found[0].unscored == 5

        await wait_for(all_finished)
    [quality] = await store.read([0], tenant="tenant-test")
    # turn 0 -> "thanks, perfect" (+1); turn 1 -> "too long" (-1); turn 2 -> silence
    assert (quality.version, quality.judged, quality.unscored) == (0, 2, 1)
    assert quality.mean_reward == pytest.approx(0.0)
    replies = [t.response.get("content") or "" for t in turns]
    words = sum(len(WORD.findall(r)) for r in replies)  # words are runs of letters
    assert quality.mean_reply_words == pytest.approx(words / 3)
    [theirs] = await store.read([0], tenant="tenant-other")  # +1, then silence
    assert (theirs.judged, theirs.unscored, theirs.mean_reward) == (1, 1, pytest.approx(1.0))
    [everyone] = await store.read()  # version 0 on every tenant's turns
    assert (everyone.judged, everyone.unscored) == (3, 2)
    assert everyone.mean_reward == pytest.approx(1 / 3)


@pytest.mark.slow
async def test_after_a_refusal_the_trainer_drops_momentum_and_lowers_its_rate(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    """A reverted optimizer keeps no first moments; each refusal in a row halves the rate."""
    writer = BatchWriter(aredis_client, data_dir)
    gate = {"max_kl": 1.0, "probe_source": "demo"}
    await writer.write(make_samples(4, seed=21), 0)
    calm = trainer_of(
        settings_for(redis_url, data_dir, trainer={"lr": 1e-6, "max_updates": 1, "gate": gate})
    )
    await calm.run()
    assert calm.version == 1
    moments = [s["exp_avg"] for s in calm._updater().optimizer.state.values()]
    assert moments and any(bool(m.abs().sum() > 0) for m in moments)

    for seed in (22, 23):
        await writer.write(make_samples(4, seed=seed), 1)
    wild = settings_for(redis_url, data_dir, trainer={"lr": 1.0, "max_updates": 2, "gate": gate})
    trainer = trainer_of(wild)  # resumes from v1, with v1's optimizer state
    await trainer.run()
    assert (trainer.version, trainer.guards.rejected, trainer.guards.refusals_in_row) == (1, 2, 2)
    assert trainer.guards.lr_scale() == pytest.approx(0.25)  # the next batch: a quarter of 1.0
    state = list(trainer._updater().optimizer.state.values())
    assert state and all(bool(s["exp_avg"].abs().sum() == 0) for s in state)
    assert any(bool(s["exp_avg_sq"].abs().sum() > 0) for s in state)  # second moments kept
    with Registry.open(wild.effective_db_url) as registry:
        rows = {v.version: v for v in registry.list_model_versions()}
    assert [rows[v].status for v in (1, 2, 3)] == ["accepted", "rejected", "rejected"]
    assert rows[2].metrics["lr"] == pytest.approx(1.0)
    assert rows[3].metrics["lr"] == pytest.approx(0.5)  # trained at half the rate
    assert rows[1].metrics["lr"] == pytest.approx(1e-6)

    await writer.write(make_samples(4, seed=24), 1)
    as_before = {**gate, "drop_momentum": False, "reject_lr_scale": 1.0}
    plain = trainer_of(
        settings_for(redis_url, data_dir, trainer={"lr": 1.0, "max_updates": 1, "gate": as_before})
    )
    await plain.run()
    assert plain.guards.rejected == 1 and plain.guards.lr_scale() == 1.0
    assert any(
        bool(s["exp_avg"].abs().sum() > 0) for s in plain._updater().optimizer.state.values()
    )

"""Probe replies sampled per probe: a probe's reply does not depend on the batch it is in, so
a gate whose set is drawn again probes version 0 and the serving version only on the probes
they have not answered, and gets what probing the whole set would have given."""

from __future__ import annotations

import math

import pytest
import redis.asyncio as aredis
import torch

from bench.gate_refresh import CountingGate
from liveloop.config import load_settings
from liveloop.contracts import TurnRecord
from liveloop.probe_sources import ProbeContext
from liveloop.trainer.policy import Policy, load_policy
from liveloop.trainer.safeguards.gate import build_panel
from liveloop.trainer.safeguards.probing import probe_seeds
from liveloop.trainer.safeguards.sampling import sample_replies
from liveloop.trainer.safeguards.sources import ServedPrompts
from tests.synthetic import make_turn, user, write_turns


def _policy() -> Policy:
    settings = load_settings(model="tiny-random")
    return load_policy("tiny-random", "cpu", settings.trainer.lora, with_reference=True)


def test_a_prompt_gets_the_same_reply_with_its_seed_whatever_shares_its_batch() -> None:
    policy = _policy()
    alone = sample_replies(
        policy.model, policy.tokenizer, [[7, 8, 9]], max_tokens=12, temperature=1.0, seeds=[5]
    )
    batch = [[40, 41, 42, 43, 44, 45], [7, 8, 9], [3]]
    together = sample_replies(
        policy.model, policy.tokenizer, batch, max_tokens=12, temperature=1.0, seeds=[1, 5, 9]
    )
    assert together.completions[1] == alone.completions[0]
    torch.testing.assert_close(together.logprobs[1], alone.logprobs[0])
    reseeded = sample_replies(
        policy.model, policy.tokenizer, batch, max_tokens=12, temperature=1.0, seeds=[1, 6, 9]
    )
    assert reseeded.completions[1] != alone.completions[0]  # another seed, another reply
    assert reseeded.completions[0] == together.completions[0]  # and the others unchanged
    assert probe_seeds(10, [[1, 2], [3], [1, 2]]) == [
        *probe_seeds(10, [[1, 2]]),
        *probe_seeds(10, [[3]]),
        probe_seeds(10, [[1, 2], [1, 2]])[1],  # the same prompt twice: two seeds
    ]


def test_per_prompt_sampling_draws_from_the_tempered_softmax() -> None:
    """The first token of 400 replies to one prompt, each with its own seed: the most likely
    token comes up as often as softmax(logits / temperature) says (within 4 sigma)."""
    policy = _policy()
    prompt = [11, 12, 13, 14]
    with torch.no_grad():
        logits = policy.model(torch.tensor([prompt])).logits[0, -1].float()
    low, high = 1e-6, 10.0  # a temperature at which the top token has about half the mass
    for _ in range(60):
        temperature = math.sqrt(low * high)
        p_top = float(torch.softmax(logits / temperature, -1).max())
        low, high = (temperature, high) if p_top > 0.5 else (low, temperature)
    n = 400
    sampled = sample_replies(
        policy.model,
        policy.tokenizer,
        [prompt] * n,
        max_tokens=1,
        temperature=temperature,
        seeds=range(n),
    )
    top = int(logits.argmax())
    share = sum(c[0] == top for c in sampled.completions) / n
    assert 0.2 < p_top < 0.9, p_top
    assert abs(share - p_top) < 4 * math.sqrt(p_top * (1 - p_top) / n), (share, p_top)


def _turns(first: int, last: int) -> list[TurnRecord]:
    return [make_turn(f"r{i}", 0, [user(f"Tell me about item {i}.")], "ok")
            for i in range(first, last)]  # fmt: skip


def _gate(redis: aredis.Redis) -> CountingGate:
    settings = load_settings(
        model="tiny-random", trainer={"gate": {"served_probes": 8, "second_draw": False}}
    )
    cfg, shared = settings.trainer.gate, settings.shared()
    source = ServedPrompts(ProbeContext(cfg, shared, redis))
    return CountingGate("tiny-random", cfg, build_panel(settings.prm, shared), source)


async def test_a_grown_probe_set_is_probed_only_on_its_new_probes_with_the_same_result(
    aredis_client: aredis.Redis,
) -> None:
    policy = _policy()
    with torch.no_grad():  # the serving version is not the reference
        for weight in policy.model.parameters():
            weight.add_(torch.randn_like(weight) * 0.2)
    gate = _gate(aredis_client)
    await write_turns(aredis_client, _turns(0, 3))
    await gate.start(policy, 1)
    assert gate.sampled == [(0, 3), (1, 3)]
    candidate = await gate.assess(policy, 2)  # the same weights: accepted, and kept
    assert candidate.accepted
    gate.accepted(candidate.on_first_set)
    await write_turns(aredis_client, _turns(3, 7))
    gate.sampled.clear()
    await gate.refresh(policy, 2)  # short: drawn again, 7 probes, 4 of them new
    assert len(gate.probes) == 7
    assert gate.sampled == [(0, 4), (2, 4)]  # the 3 known probes are not sampled again
    kept = gate.reference_prompts  # the reference ran each prompt once: 3, then 4 new ones
    prompts = gate._rendered(policy, False)[0]
    assert set(kept.entries) == {tuple(p) for p in prompts} and kept.encoded == 7
    fresh = _gate(aredis_client)
    await fresh.start(policy, 2)  # the whole set at once
    assert fresh.sampled == [(0, 7), (2, 7)] and fresh.probes == gate.probes
    for version in (0, 2):
        reused, whole = gate._on_first[version], fresh._on_first[version]
        assert [r.reply for r in reused.replies] == [r.reply for r in whole.replies]
        sums = {"seconds", "kl_ref", "ref_nll"}  # sums over the tokens, in another order
        assert reused.result().model_dump(exclude=sums) == whole.result().model_dump(exclude=sums)
        for name in ("kl_ref", "ref_nll"):
            assert getattr(reused.result(), name) == pytest.approx(getattr(whole.result(), name))
    assert gate.version0 is not None and gate.version0.probes == 7
    short = gate.probes
    await write_turns(aredis_client, _turns(7, 30))
    gate.sampled.clear()
    await gate.refresh(policy, 2)  # topped up: the 7 stay, 1 of the 23 new requests added
    assert len(gate.probes) == 8 and all(p in gate.probes for p in short)
    assert gate.sampled == [(0, 1), (2, 1)] and gate.version0.probes == 8
    full = await gate.source.draw()  # a full set is drawn afresh: a seeded sample of 30
    assert len(full) == 8 and full == await gate.source.draw() and full != gate.probes

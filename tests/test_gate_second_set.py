"""The promotion gate's second probe set is looked at only when the first finds a candidate
beyond a drift bound: a candidate within the bounds costs one set, a doubtful one is decided
on both sets together, and the serving version's reward is compared on the first set.

The replies are scripted (no model samples them): what is under test is which sets the
gate measures and how it decides on them, with the real `summarise` and `pooled`.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch

from liveloop.config import load_settings
from liveloop.probe_sources import Probe, ProbeContext, ProbeSource
from liveloop.trainer.policy import Policy
from liveloop.trainer.safeguards.gate import PromotionGate, build_panel
from liveloop.trainer.safeguards.probing import Measured, ProbeReply, pooled

SET_SIZE = 10
BREAD = frozenset({"bread", "breads"})


def _probes(first_index: int) -> list[Probe]:
    return [Probe.asking(f"Tell me about bread, #{first_index + i}.", topic=BREAD)
            for i in range(SET_SIZE)]  # fmt: skip


class TwoSets(ProbeSource):
    """A source with a first set and, asked for more, a second one."""

    name = "two-sets"

    async def draw(self) -> list[Probe]:
        return _probes(0)

    async def draw_more(self, taken: list[Probe]) -> list[Probe]:
        return _probes(SET_SIZE)


def _measured(version: int, probes: list[Probe], on_topic: int, reward: float) -> Measured:
    """`on_topic` of the replies name bread, the rest talk about cats; every reply is scored
    `reward` and has the reference's log-probs (no KL, no NLL change)."""
    texts = [
        "Bread is baked from flour and water." if i < on_topic else "Cats sleep most of the day."
        for i in range(len(probes))
    ]
    replies = [ProbeReply(question=p.question, reply=t, score=reward)
               for p, t in zip(probes, texts, strict=True)]  # fmt: skip
    logprobs = [torch.full((6,), -1.0) for _ in probes]
    return Measured(version, probes, replies, logprobs, [x.clone() for x in logprobs])


class ScriptedGate(PromotionGate):
    """The gate, with each version's replies to each set scripted: (on topic, reward)."""

    def __init__(self, script: dict[tuple[int, bool], tuple[int, float]]) -> None:
        settings = load_settings(model="smollm2-135m")  # topic bound: a 20-point drop
        cfg, shared = settings.trainer.gate, settings.shared()
        super().__init__(
            "smollm2-135m",
            cfg,
            build_panel(settings.prm, shared),
            TwoSets(ProbeContext(cfg, shared)),
        )
        self.script = script
        self.measured: list[tuple[int, bool]] = []

    async def _measure(
        self,
        policy: Policy,
        version: int,
        weights: Any = None,
        *,
        second: bool = False,
        kept: bool = False,
    ) -> Measured:
        self.measured.append((version, second))
        on_topic, reward = self.script[(version, second)]
        return _measured(version, self.more if second else self.probes, on_topic, reward)


NO_POLICY = cast(Policy, None)  # the scripted gate never samples


async def test_a_doubtful_candidate_is_decided_on_both_sets_and_a_clear_one_on_the_first() -> None:
    gate = ScriptedGate({
        (0, False): (8, 0.5), (0, True): (8, 0.5),  # version 0: 80% on topic on each set
        (1, False): (5, 0.5), (1, True): (9, 0.5),  # serving: 50% (beyond) then 90%
        (2, False): (5, 0.5), (2, True): (9, 0.5),  # like the serving version: 70% on both
        (3, False): (9, 0.5),  # clearly within: never meets the second set
        (4, False): (5, 0.5), (4, True): (4, 0.5),  # beyond on both: 45% against 80%
        (5, False): (5, -0.5),  # beyond, and its reward a whole point below: refused at once
    })  # fmt: skip
    await gate.start(NO_POLICY, serving_version=1)
    assert len(gate.probes) == len(gate.more) == SET_SIZE
    assert gate.measured == [(0, False), (1, False), (0, True), (1, True)]
    assert gate.version0 is not None and gate.version0.probes == SET_SIZE
    assert gate.version0_both is not None and gate.version0_both.probes == 2 * SET_SIZE
    assert gate.serving is not None and gate.serving.version == 1
    assert gate.serving.probes == SET_SIZE  # candidates' reward is compared on the first set

    gate.measured.clear()
    doubtful = await gate.assess(NO_POLICY, 2)
    assert doubtful.accepted and gate.measured == [(2, False), (2, True)]
    assert doubtful.probe.probes == 2 * SET_SIZE and doubtful.probe.topic_rate == 0.7
    assert doubtful.on_first_set.probes == SET_SIZE and doubtful.on_first_set.topic_rate == 0.5
    assert "within the bounds on all 20 probes" in str(doubtful.reason)
    assert "topic rate 50%" in str(doubtful.reason)  # what the first set alone found
    gate.accepted(doubtful.on_first_set)
    assert gate.serving.version == 2 and gate.serving.probes == SET_SIZE

    gate.measured.clear()
    clear = await gate.assess(NO_POLICY, 3)
    assert clear.accepted and clear.reason is None and clear.first is None
    assert gate.measured == [(3, False)] and clear.probe.probes == SET_SIZE

    gate.measured.clear()
    beyond = await gate.assess(NO_POLICY, 4)
    assert not beyond.accepted and beyond.probe.probes == 2 * SET_SIZE
    assert "topic rate 45% is below version 0's 80%" in str(beyond.reason)
    assert gate.measured == [(4, False), (4, True)]

    gate.measured.clear()
    worse = await gate.assess(NO_POLICY, 5)
    assert not worse.accepted and gate.measured == [(5, False)]  # the second set cannot save it
    assert "probe reward -0.500 is below" in str(worse.reason)


async def test_without_a_second_draw_the_first_set_decides_alone() -> None:
    gate = ScriptedGate({(0, False): (8, 0.5), (1, False): (5, 0.5), (2, False): (5, 0.5)})
    gate.cfg = gate.cfg.model_copy(update={"second_draw": False})
    await gate.start(NO_POLICY, serving_version=1)
    assert gate.more == [] and gate.version0_both is None
    verdict = await gate.assess(NO_POLICY, 2)
    assert not verdict.accepted and verdict.probe.probes == SET_SIZE
    assert gate.measured == [(0, False), (1, False), (2, False)]


def test_two_sets_pooled_read_as_one_set() -> None:
    """Shares and per-token means of the pooled sets are those of the replies together."""
    first = _measured(3, _probes(0), on_topic=8, reward=1.0)
    second = _measured(3, _probes(SET_SIZE), on_topic=2, reward=0.0)
    second.logprobs = [torch.full((2,), -1.0) for _ in second.probes]  # shorter replies
    second.reference = [torch.full((2,), -3.0) for _ in second.probes]  # the reference: less likely
    both = pooled(first, second).result()
    assert both.probes == 20 and both.topic_rate == 0.5 and both.reward == 0.5
    # reference NLL per token: (60 tokens x 1 + 20 tokens x 3) / 80 tokens
    assert both.ref_nll == pytest.approx(120 / 80)
    assert first.result().ref_nll == pytest.approx(1.0) and first.result().probes == 10


async def test_a_candidate_beyond_a_bound_draws_the_second_set_when_told_to() -> None:
    """With `second_set_for_candidates`, the serving version within the bounds leaves the
    first set alone until a candidate is beyond a drift bound on it: then version 0 answers
    a second set once, and that candidate and later doubtful ones are decided on both."""
    gate = ScriptedGate({
        (0, False): (8, 0.5), (0, True): (8, 0.5),  # version 0: 80% on topic on each set
        (1, False): (8, 0.5),  # the serving version, within the bounds: no second set
        (2, False): (5, 0.5), (2, True): (9, 0.5),  # 50% then 90%: 70% on both, within
        (3, False): (5, 0.5), (3, True): (4, 0.5),  # 45% on both: beyond
    })  # fmt: skip
    gate.cfg = gate.cfg.model_copy(update={"second_set_for_candidates": True})
    await gate.start(NO_POLICY, serving_version=1)
    assert gate.more == [] and gate.version0_both is None
    gate.measured.clear()

    doubtful = await gate.assess(NO_POLICY, 2)
    assert gate.measured == [(2, False), (0, True), (2, True)]
    assert doubtful.accepted and doubtful.probe.probes == 2 * SET_SIZE
    assert gate.version0_both is not None and gate.version0_both.probes == 2 * SET_SIZE
    gate.measured.clear()

    beyond = await gate.assess(NO_POLICY, 3)
    assert gate.measured == [(3, False), (3, True)]  # version 0's second replies stand
    assert not beyond.accepted and "topic rate 45%" in str(beyond.reason)


async def test_by_default_the_first_set_decides_while_the_serving_version_is_within() -> None:
    gate = ScriptedGate({(0, False): (8, 0.5), (1, False): (8, 0.5), (2, False): (5, 0.5)})
    await gate.start(NO_POLICY, serving_version=1)
    verdict = await gate.assess(NO_POLICY, 2)
    assert not verdict.accepted and verdict.probe.probes == SET_SIZE and gate.more == []
    assert gate.measured == [(0, False), (1, False), (2, False)]

"""The gate's share bounds weigh a change against paired sampling noise: a candidate and
version 0 answer the same probes, so the probes where they differ say whether a drop in the
topic rate (or a rise in non-answers) is more than chance."""

from __future__ import annotations

import random

from liveloop.config import load_settings
from liveloop.probe_sources import ProbeContext
from liveloop.trainer.safeguards.gate import PromotionGate, build_panel
from liveloop.trainer.safeguards.probing import ProbeMarks, ProbeResult
from liveloop.trainer.safeguards.sources import ServedPrompts

PROBES = 24


def _gate(**gate: float | None) -> PromotionGate:
    """smollm2's gate with 10-point share bounds (the tenants demo's)."""
    bounds = {"max_topic_drop": 0.1, "max_nonsense_rise": 0.1, "reward_margin": 2.0}
    settings = load_settings(model="smollm2-135m", trainer={"gate": bounds | gate})
    cfg, shared = settings.trainer.gate, settings.shared()
    source = ServedPrompts(ProbeContext(cfg, shared))
    return PromotionGate(settings.model, cfg, build_panel(settings.prm, shared), source)


def _result(version: int, on_topic: set[int], no_answer: set[int] | None = None) -> ProbeResult:
    """24 probe replies: those in `on_topic` name the topic, those in `no_answer` are none."""
    no_answer = no_answer or set()
    marks = [ProbeMarks(on_topic=i in on_topic, no_answer=i in no_answer) for i in range(PROBES)]
    return ProbeResult(version=version, probes=PROBES, scored=PROBES, reward=0.0, ref_nll=3.0,
                       kl_ref=0.1, mean_words=20.0, distinct_2=0.9,
                       topic_rate=len(on_topic) / PROBES, symbol_share=0.0,
                       nonsense_share=len(no_answer) / PROBES, marks=marks)  # fmt: skip


def _decide(gate: PromotionGate, version0: ProbeResult, candidate: ProbeResult) -> bool:
    gate.version0 = gate.serving = version0
    return gate.decide(candidate).accepted


def test_a_drop_beyond_the_bound_refuses_only_where_the_paired_probes_say_it_is_real() -> None:
    version0 = _result(0, set(range(20)))  # 20 of 24 on topic
    # 17 of 24 (12.5 points lower): 5 probes lost the topic (15-19), 2 found it (20, 21);
    # (5 - 2) / sqrt(5 + 2) = 1.13 standard errors: noise
    mixed = _result(1, set(range(15)) | {20, 21})
    # 16 of 24 (16.7 points lower): 4 probes lost it, none found it; 4 / sqrt(4) = 2.0: beyond
    lost = _result(1, set(range(16)))
    gate = _gate()
    assert _decide(gate, version0, mixed)
    assert not _decide(gate, version0, lost)
    verdict = gate.decide(lost)
    assert "topic rate 67% is below version 0's 83% by more than 10%" in str(verdict.reason)
    assert not _decide(_gate(loss_z=None), version0, mixed)  # the bound alone: refused
    # 18 of 24 (2 lost, none found): 8.3 points, within the bound whatever the pairs say
    assert _decide(gate, version0, _result(1, set(range(18))))


def test_a_rise_in_non_answers_is_weighed_the_same_way() -> None:
    version0 = _result(0, set(range(PROBES)), no_answer={0, 1, 2})  # 3 of 24 no answer
    # 6 of 24 (12.5 points more): 5 new (3-7), 2 recovered (0, 1); 3 / sqrt(7) = 1.13: noise
    assert _decide(_gate(), version0, _result(1, set(range(PROBES)), set(range(2, 8))))
    # 7 of 24 (16.7 points more): 4 new, none recovered; 4 / sqrt(4) = 2.0: beyond
    assert not _decide(_gate(), version0, _result(1, set(range(PROBES)), set(range(7))))
    # results without marks (an older record, a plugin's summary): the bound alone decides
    bare = _result(1, set(range(PROBES)), set(range(2, 8))).model_copy(update={"marks": []})
    assert not _decide(_gate(), version0, bare)


def _sampled(rates: list[float], rng: random.Random) -> set[int]:
    return {i for i, p in enumerate(rates) if rng.random() < p}


def test_the_same_version_sampled_twice_is_rarely_refused_and_a_real_drop_mostly_is() -> None:
    """Seeded simulation. Each probe has its own chance of a reply naming its topic (the
    questions differ: 0.5, 0.8 or 0.95); two versions answer all 24 independently. The same
    version against itself: the 10-point bound alone refuses about one pair in six, the
    paired rule about one in twenty. A version whose every chance is 25 points lower
    (floored at 0): the paired rule refuses about 60% of them, the bound alone about 90%; a
    drop that lasts meets the rule again at every later version, since the bound is against
    version 0."""
    rng = random.Random(7)
    paired, bound_alone = _gate(), _gate(loss_z=None)
    refused = {"paired": 0, "bound alone": 0, "real drop": 0, "real drop, bound alone": 0}
    trials = 1000
    for _ in range(trials):
        rates = [rng.choice([0.5, 0.8, 0.95]) for _ in range(PROBES)]
        version0 = _result(0, _sampled(rates, rng))
        same = _result(1, _sampled(rates, rng))
        worse = _result(1, _sampled([max(p - 0.25, 0.0) for p in rates], rng))
        refused["paired"] += not _decide(paired, version0, same)
        refused["bound alone"] += not _decide(bound_alone, version0, same)
        refused["real drop"] += not _decide(paired, version0, worse)
        refused["real drop, bound alone"] += not _decide(bound_alone, version0, worse)
    assert refused["paired"] < 0.06 * trials, refused  # 48 of 1000
    assert refused["bound alone"] > 0.15 * trials, refused  # 172
    assert refused["real drop"] > 0.5 * trials, refused  # 609 (bound alone: 878)

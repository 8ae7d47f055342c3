"""The demo report's quality checks tell a loss from sampling noise.

The held-out replies are a few dozen, sampled at temperature 1: two versions of about the
same quality often differ by more than a check's slack, so a check must also see the
difference beyond sampling noise before it calls quality lost.
"""

from __future__ import annotations

import random
from typing import Any

from liveloop.demo.report import headline


def _checks(base: dict[str, Any], final: dict[str, Any]) -> dict[str, bool | None]:
    kept: dict[str, bool | None] = headline({"eval": {"version 0": base, "final": final}})[
        "quality_kept"
    ]
    return kept


def _replies(turns: int, on_topic: int, non_answers: int) -> dict[str, Any]:
    return {
        "turns": turns,
        "topic_rate": on_topic / turns,
        "non_answer_share": non_answers / turns,
        "symbol_share": 0.0,
    }


def test_a_difference_within_sampling_noise_keeps_the_checks() -> None:
    # 20 -> 18 of 24 on topic: 8 points lower (beyond the 5-point slack), but the pooled
    # standard error of the difference is sqrt(.79 * .21 * 2/24) = 0.118, so 0.7 of one.
    # 1 -> 3 of 24 non-answers: 8 points higher, 1.0 standard error (0.080).
    checks = _checks(_replies(24, 20, 1), _replies(24, 18, 3))
    assert checks["topic_rate"] is True and checks["non_answers"] is True


def test_a_loss_beyond_sampling_noise_fails_the_checks() -> None:
    # 22 -> 14 of 24 on topic: 33 points, 2.7 standard errors (0.125);
    # 0 -> 4 of 24 non-answers: 17 points, 2.1 standard errors (0.080).
    checks = _checks(_replies(24, 22, 0), _replies(24, 14, 4))
    assert checks["topic_rate"] is False and checks["non_answers"] is False


def test_more_replies_make_the_same_difference_a_loss() -> None:
    # The 8-point changes of the first test, measured on 240 replies each: 2.2 and 3.3
    # standard errors.
    checks = _checks(_replies(240, 200, 10), _replies(240, 180, 30))
    assert checks["topic_rate"] is False and checks["non_answers"] is False


def test_without_reply_counts_only_the_slack_applies() -> None:
    base, final = _replies(24, 20, 1), _replies(24, 18, 3)
    for figures in (base, final):
        del figures["turns"]
    checks = _checks(base, final)
    assert checks["topic_rate"] is False and checks["non_answers"] is False


def test_the_same_weights_sampled_twice_rarely_fail_a_check() -> None:
    """Two samples of 24 replies from one model (80% on topic, 8% non-answers, about the
    demo's version 0): the checks fail on under 10% of the pairs, the slack alone on over a
    third of them."""
    rng = random.Random(0)

    def sample() -> dict[str, Any]:
        on_topic = sum(rng.random() < 0.8 for _ in range(24))
        return _replies(24, on_topic, sum(rng.random() < 0.08 for _ in range(24)))

    def uncounted(figures: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in figures.items() if k != "turns"}

    pairs = [(sample(), sample()) for _ in range(1000)]
    noise_aware = [_checks(base, final) for base, final in pairs]
    slack_only = [_checks(uncounted(base), uncounted(final)) for base, final in pairs]
    assert sum(not (c["topic_rate"] and c["non_answers"]) for c in noise_aware) < 100
    assert sum(not (c["topic_rate"] and c["non_answers"]) for c in slack_only) > 333


def test_symbols_are_lost_only_beyond_two_percent_and_version_0s_share() -> None:
    base, final = _replies(24, 20, 1), _replies(24, 20, 1)
    assert _checks(base, final)["symbols"] is True  # none either side
    final["symbol_share"] = 1 / 24
    assert _checks(base, final)["symbols"] is False  # one reply in 24 where the base had none
    base["symbol_share"] = 1 / 24
    assert _checks(base, final)["symbols"] is True  # the base's own share: nothing lost
    final["symbol_share"] = 2 / 24
    assert _checks(base, final)["symbols"] is False

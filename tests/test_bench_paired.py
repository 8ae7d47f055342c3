"""The paired-round statistics behind bench/gateway.py's verdicts (a wrong interval would
call noise a result)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def paired() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "bench" / "paired.py"
    spec = importlib.util.spec_from_file_location("bench_paired", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_median_ci_uses_the_binomial_order_statistics(paired: ModuleType) -> None:
    # n = 16: P(B <= 3) = 697/65536 <= 2.5% < P(B <= 4), so the 4th and 13th values.
    assert paired.median_ci([float(x) for x in range(16)]) == [3.0, 12.0]
    assert paired.median_ci([5.0, 1.0, 3.0]) == [1.0, 5.0]  # too few for 95%: the range


def test_median_ci_covers_the_true_median_at_least_95_percent(paired: ModuleType) -> None:
    rng = random.Random(7)
    for n in (12, 40):
        hits = sum(
            lo <= 0.0 <= hi
            for lo, hi in (
                paired.median_ci([rng.gauss(0.0, 3.0) for _ in range(n)]) for _ in range(2000)
            )
        )
        assert hits / 2000 >= 0.94


def test_judge_says_within_noise_when_the_interval_straddles_the_target(
    paired: ModuleType,
) -> None:
    assert paired.judge(1.5, [1.0, 1.9], 2.0)["verdict"] == "met"
    assert paired.judge(3.0, [2.1, 4.0], 2.0)["verdict"] == "not met"
    straddling = paired.judge(1.5, [1.0, 2.5], 2.0)
    assert straddling["met"] is True and straddling["verdict"] == "within noise"


def test_compare_pairs_rounds(paired: ModuleType) -> None:
    def rnd(ttft: float, e2e: float) -> list[dict[str, float]]:
        return [{"ttft": ttft, "e2e": e2e, "tokens": 10.0}]

    base = [rnd(0.010, 1.0), rnd(0.020, 1.0), rnd(0.030, 1.0)]
    tested = [rnd(0.011, 1.1), rnd(0.022, 1.25), rnd(0.033, 1.0)]
    out = paired.compare(base, tested)
    assert out["ttft_ms_p50_added"] == pytest.approx(2.0)
    assert out["tokens_per_s_drop_pct"] == pytest.approx(100 * (1 - 1 / 1.1), abs=0.01)

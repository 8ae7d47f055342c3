"""Statistics for benchmarks that run two paths in paired rounds (`gateway.py`).

Why: on a small shared machine the speed drifts from minute to minute, so one run's median
can sit on either side of a target by chance. Each round of one path runs right next to
the same round of the other; the overhead is the median of the per-round differences, and
it comes with a 95% confidence interval so that a verdict says when the run could not tell.

A round is a list of streams, each a dict with `ttft` and `e2e` (seconds) and `tokens`.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

Round = list[dict[str, float]]


def summarize(runs: list[Round]) -> dict[str, float]:
    """Median/p90 TTFT and e2e (ms) over all streams, tokens/s over each round's wall time."""
    streams = [s for rnd in runs for s in rnd]
    ttft = sorted(s["ttft"] * 1e3 for s in streams)
    e2e = sorted(s["e2e"] * 1e3 for s in streams)
    return {
        "ttft_ms_p50": round(statistics.median(ttft), 3),
        "ttft_ms_p90": round(ttft[int(0.9 * (len(ttft) - 1))], 3),
        "e2e_ms_p50": round(statistics.median(e2e), 3),
        "tokens_per_s": round(statistics.median(round_tps(rnd) for rnd in runs), 1),
        "streams": len(streams),
    }


def round_tps(rnd: Round) -> float:
    """Generated tokens per second of one round (all its streams, over the slowest one)."""
    return sum(s["tokens"] for s in rnd) / max(s["e2e"] for s in rnd)


def round_median(rnd: Round, key: str) -> float:
    """Median of one metric over a round's streams, in ms."""
    return statistics.median(s[key] * 1e3 for s in rnd)


def compare(
    baseline: list[Round], tested: list[Round], names: tuple[str, str] = ("inprocess", "http")
) -> dict[str, Any]:
    """Both summaries (under `names`) and what `tested` adds: medians of per-round
    differences (ratios for tokens/s), each with the interquartile range of the per-round
    figures (how much one round varies) and a 95% confidence interval of the median (how
    far this run's figure can be trusted)."""
    pairs = list(zip(baseline, tested, strict=True))
    ttft = [round_median(t, "ttft") - round_median(b, "ttft") for b, t in pairs]
    e2e = [round_median(t, "e2e") - round_median(b, "e2e") for b, t in pairs]
    drop = [100.0 * (1.0 - round_tps(t) / round_tps(b)) for b, t in pairs]
    return {
        names[0]: summarize(baseline),
        names[1]: summarize(tested),
        "ttft_ms_p50_added": round(statistics.median(ttft), 3),
        "ttft_ms_added_iqr": quartiles(ttft),
        "ttft_ms_p50_added_ci95": median_ci(ttft),
        "e2e_ms_p50_added": round(statistics.median(e2e), 3),
        "tokens_per_s_drop_pct": round(statistics.median(drop), 2),
        "tokens_per_s_drop_pct_iqr": quartiles(drop),
        "tokens_per_s_drop_pct_ci95": median_ci(drop),
    }


def quartiles(values: list[float]) -> list[float]:
    """[first, third] quartile of per-round figures."""
    if len(values) < 2:
        return [round(values[0], 2)] * 2
    q1, _, q3 = statistics.quantiles(values, n=4)
    return [round(q1, 2), round(q3, 2)]


def median_ci(values: list[float], confidence: float = 0.95) -> list[float]:
    """A distribution-free confidence interval of the median: two order statistics.

    [x(r), x(n-r+1)] covers the median with probability 1 - 2 P(B <= r-1), B ~ Bin(n, 1/2);
    r is the largest that keeps the coverage at `confidence` or more. Below 6 values no
    such r exists and the whole range is returned (it covers less than 95%).
    """
    xs = sorted(values)
    n = len(xs)
    tail = (1.0 - confidence) / 2.0
    below, r = 0.0, 0
    while below + math.comb(n, r) / 2**n <= tail:
        below += math.comb(n, r) / 2**n
        r += 1
    lo, hi = (xs[r - 1], xs[n - r]) if r >= 1 else (xs[0], xs[-1])
    return [round(lo, 2), round(hi, 2)]


def judge(measured: float, ci95: list[float], target: float) -> dict[str, Any]:
    """One at-most target: the median against it, and whether the run could tell.

    `met` compares the median; `verdict` is "met" or "not met" only when the whole
    confidence interval is on that side of the target, else "within noise".
    """
    if ci95[1] <= target:
        verdict = "met"
    elif ci95[0] > target:
        verdict = "not met"
    else:
        verdict = "within noise"
    return {
        "target": target,
        "measured": measured,
        "ci95": ci95,
        "met": measured <= target,
        "verdict": verdict,
    }

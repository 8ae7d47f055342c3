"""Learning curves over judged turns: windows, moving means, and turns to a threshold.

The demo's report and `bench/learning.py` both measure how fast a run learns in the same
terms: the judged scores in the order the judge produced them, their mean per window of
turns, and the number of judged turns until the moving mean first reaches a threshold.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def window_means(scores: Sequence[float], window: int) -> list[float]:
    """Mean score of each full consecutive window of `window` turns (a short tail too)."""
    out = []
    for start in range(0, len(scores), window):
        part = scores[start : start + window]
        if len(part) >= max(1, window // 2):
            out.append(sum(part) / len(part))
    return out


def gain_standard_error(first: Sequence[float], last: Sequence[float]) -> float | None:
    """Standard error of `mean(last) - mean(first)`, the windows taken as independent samples
    (None when either has fewer than two scores). With scores of -1, 0 or +1 a window of 64
    turns gives a gain of about +-0.15; a difference of two such gains about +-0.2."""
    if len(first) < 2 or len(last) < 2:
        return None
    spread = statistics.variance
    return math.sqrt(spread(first) / len(first) + spread(last) / len(last))


def moving_mean(scores: Sequence[float], window: int) -> list[float]:
    """Mean of the last `window` scores at each turn (fewer at the start)."""
    out = []
    total = 0.0
    for i, score in enumerate(scores):
        total += score
        if i >= window:
            total -= scores[i - window]
        out.append(total / min(i + 1, window))
    return out


def turns_to_threshold(scores: Sequence[float], threshold: float, window: int) -> int | None:
    """Judged turns until the moving mean of `window` turns first reaches `threshold`.

    Only full windows count (the first `window - 1` turns cannot reach it); None when it is
    never reached.
    """
    for i, value in enumerate(moving_mean(scores, window)):
        if i + 1 >= window and value >= threshold:
            return i + 1
    return None

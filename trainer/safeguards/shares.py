"""How the promotion gate compares two versions' shares: by more than a bound, and beyond
sampling noise, probe by probe.

The gate's share bounds (topic rate, no-answer share, sense rate) compare a candidate with
version 0 on the same probes. On a few dozen probes sampled at temperature 1, a version as
good as version 0 moves such a share by a few replies from sampling alone: on 24 probes one
reply is 4 points, and a 10-point bound is three replies. Because both versions answer the
same probes, their marks pair up, and only the probes where they differ carry evidence: a
change counts as beyond noise where the probes that got worse outnumber those that got
better by more than `z` standard errors (McNemar's test, one-sided).
"""

from __future__ import annotations

import math
from typing import Literal

from liveloop.trainer.safeguards.probing import ProbeResult

Mark = Literal["on_topic", "no_answer", "sensible"]
FLOAT_SLACK = 1e-9  # shares of a few probes are fractions: compare bounds with this slack


def by_more_than(high: float, low: float, bound: float) -> bool:
    """Whether `high` exceeds `low` by more than `bound`; by exactly the bound (one reply in
    ten against a 10-point bound: 0.8 - 0.7 is 0.10000000000000009) it does not."""
    return high - low > bound + FLOAT_SLACK


def worse_beyond_noise(
    before: ProbeResult, after: ProbeResult, mark: Mark, *, good: bool, z: float | None
) -> bool:
    """Whether `after`'s `mark` is worse than `before`'s beyond sampling noise (`good` is the
    mark's good value). Without per-probe marks for both on the same probes, or without a
    `z`, there is no paired evidence to weigh: True, and the bound alone decides."""
    if z is None or not before.marks or len(before.marks) != len(after.marks):
        return True
    worse = better = 0
    for old, new in zip(before.marks, after.marks, strict=True):
        was, now = getattr(old, mark), getattr(new, mark)
        if was is None or now is None or was == now:
            continue
        worse += was == good
        better += now == good
    return worse - better > z * math.sqrt(worse + better)

"""Bounded Prometheus label values: the busiest few by name, everything else as `other`.

Adapters and tenants are unbounded sets: a label per tenant would grow a time series per
tenant forever. `TopLabels` names at most `limit` values, the busiest by traffic seen (a
newcomer takes the place of the least busy named one once it has had twice its traffic),
and calls `on_evict` for a name it drops so the caller can remove that series.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

OTHER = "other"


class TopLabels:
    """Maps a value to itself while it is among the busiest `limit`, else to `other`."""

    def __init__(self, limit: int, on_evict: Callable[[str], None] | None = None) -> None:
        self.limit = limit
        self.on_evict = on_evict
        self.named: set[str] = set()
        self.counts: Counter[str] = Counter()

    def label(self, value: str, weight: int = 1) -> str:
        """The label to count `value` under (its traffic is counted too)."""
        self.counts[value] += weight
        self._bound_counts()
        if value in self.named:
            return value
        if len(self.named) < self.limit:
            self.named.add(value)
            return value
        weakest = min(self.named, key=lambda v: (self.counts[v], v))
        if self.counts[value] <= 2 * self.counts[weakest]:
            return OTHER
        self.named.discard(weakest)
        self.named.add(value)
        if self.on_evict is not None:
            self.on_evict(weakest)
        return value

    def _bound_counts(self) -> None:
        """Keep the traffic of at most 16x `limit` values (the least busy are forgotten)."""
        if len(self.counts) > 16 * max(self.limit, 1):
            keep = dict(self.counts.most_common(8 * max(self.limit, 1)))
            keep.update({v: self.counts[v] for v in self.named})
            self.counts = Counter(keep)

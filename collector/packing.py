"""Packing turns into batches by a token budget (sorted first-fit), and when to ship them.

Turns are packed first-fit decreasing (`liveloop.samples.first_fit_decreasing`: longest
first, each into the first batch with room; a turn longer than the whole budget gets a
batch of its own). A batch
ships when it holds `min_turns` turns, or `min_fill` of the budget, or when its oldest
turn has waited `max_wait_s`; the others go back to wait for more turns. When only a few
batches may ship (the trainer's queue is bounded), they are packed from the freshest turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from liveloop.collector.advantages import PendingSample
from liveloop.samples import first_fit_decreasing


@dataclass
class Bin:
    """One batch being packed."""

    samples: list[PendingSample] = field(default_factory=list)
    tokens: int = 0

    @property
    def oldest(self) -> float:
        """Arrival time of the earliest turn in the batch."""
        return min(p.arrived_at for p in self.samples)


def first_fit(samples: Sequence[PendingSample], budget: int) -> list[Bin]:
    """Sorted first-fit: longest turn first (ties: earliest, then by key), each into the
    first batch with room for it (`liveloop.samples.first_fit_decreasing`)."""
    packed = first_fit_decreasing(
        samples, lambda p: p.tokens, budget, lambda p: (p.arrived_at, p.key)
    )
    return [Bin(b, sum(p.tokens for p in b)) for b in packed]


@dataclass(frozen=True)
class FlushPolicy:
    """When a packed batch is ready to ship."""

    token_budget: int
    min_turns: int
    min_fill: float
    max_wait_s: float

    def ready(self, b: Bin, now: float) -> bool:
        """Whether this batch ships now."""
        return (
            len(b.samples) >= self.min_turns
            or b.tokens >= self.min_fill * self.token_budget
            or now - b.oldest >= self.max_wait_s
        )

    def worth_packing(self, samples: Sequence[PendingSample], now: float) -> bool:
        """Cheap test whether packing could produce a ready batch at all."""
        if not samples:
            return False
        if len(samples) >= self.min_turns:
            return True
        if sum(p.tokens for p in samples) >= self.min_fill * self.token_budget:
            return True
        return now - min(p.arrived_at for p in samples) >= self.max_wait_s

    def split(
        self, samples: Sequence[PendingSample], now: float, limit: int | None = None
    ) -> tuple[list[Bin], list[PendingSample]]:
        """(batches to ship now, samples to keep waiting).

        With a `limit`, at most that many batches ship, packed from the freshest turns
        (`freshest_first`); the others keep waiting.
        """
        keep: list[PendingSample] = []
        if limit is not None:
            samples, keep = self._freshest(samples, limit)
        ship: list[Bin] = []
        for b in first_fit(samples, self.token_budget):
            if self.ready(b, now) and (limit is None or len(ship) < limit):
                ship.append(b)
            else:
                keep.extend(b.samples)
        return ship, keep

    def _freshest(
        self, samples: Sequence[PendingSample], limit: int
    ) -> tuple[list[PendingSample], list[PendingSample]]:
        """(the freshest turns that fill `limit` batches' token budgets, the rest)."""
        ordered = freshest_first(samples)
        room = limit * self.token_budget
        taken = 0
        for i, p in enumerate(ordered):
            if i > 0 and taken + p.tokens > room:
                return ordered[:i], ordered[i:]
            taken += p.tokens
        return ordered, []


def freshest_first(samples: Sequence[PendingSample]) -> list[PendingSample]:
    """Newest oldest-token version first (the least stale), then the latest arrival."""
    return sorted(samples, key=lambda p: (p.oldest_version, p.arrived_at), reverse=True)

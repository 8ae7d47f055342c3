"""The rules about token data that several loops apply, each defined once.

A turn (`TurnRecord`, `ScoredTurn`) and a training sample (`BatchSample`) carry the same
token data: prompt and completion ids, the behaviour log-prob of each completion token
(`logprobs`) and the policy version that produced it (`versions`). On that data:

- `num_tokens`: how many tokens it occupies in a forward pass (prompt + completion);
- `min_version`: the oldest version that produced one of its tokens (the version a turn
  belongs to, and the one staleness is measured from);
- `staleness` / `within_staleness`: how many versions it lags behind the trainer, and the
  `max_staleness` bound the collector applies and the trainer applies again;
- `untrainable`: why it cannot be trained on (the same check in collector and trainer);
- `first_fit_decreasing`: packing by a token budget (collector batches, trainer
  micro-batches).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

T = TypeVar("T")


class Versioned(Protocol):
    """Anything that records the policy version of each completion token."""

    @property
    def versions(self) -> Sequence[int]: ...


class TokenData(Versioned, Protocol):
    """Token-exact data of a turn or a sample."""

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def completion_token_ids(self) -> Sequence[int]: ...

    @property
    def logprobs(self) -> Sequence[float]: ...


def num_tokens(sample: TokenData) -> int:
    """Tokens the sample occupies in a forward pass: prompt + completion."""
    return len(sample.prompt_token_ids) + len(sample.completion_token_ids)


def min_version(sample: Versioned) -> int:
    """The oldest policy version that produced a token of this sample (0 without tokens)."""
    return min(sample.versions) if sample.versions else 0


def staleness(sample: Versioned, trainer_version: int) -> int:
    """Versions between the sample's oldest token and the trainer's current version."""
    return trainer_version - min_version(sample)


def within_staleness(sample: Versioned, trainer_version: int, max_staleness: int) -> bool:
    """Whether the sample may still be trained on (`max_staleness` 0: on-policy only)."""
    return staleness(sample, trainer_version) <= max_staleness


@dataclass(frozen=True)
class Untrainable:
    """Why a sample cannot be trained on: `reason` (a metric label) and `detail` (for logs)."""

    reason: Literal["empty", "invalid"]
    detail: str


def untrainable(sample: TokenData) -> Untrainable | None:
    """Why this sample cannot be trained on, or None when it can."""
    if not sample.prompt_token_ids:
        return Untrainable("empty", "empty prompt")
    if not sample.completion_token_ids:
        return Untrainable("empty", "empty completion")
    n = len(sample.completion_token_ids)
    if len(sample.logprobs) != n:
        return Untrainable("invalid", "logprobs and completion differ in length")
    if len(sample.versions) != n:
        return Untrainable("invalid", "versions and completion differ in length")
    return None


def first_fit_decreasing(
    items: Iterable[T], size: Callable[[T], int], budget: int, order: Callable[[T], Any]
) -> list[list[T]]:
    """Pack items into bins of at most `budget`: largest first (ties broken by `order`),
    each into the first bin with room; an item larger than the budget gets a bin of its own.

    First-fit decreasing uses at most 11/9 of the optimal number of bins, plus one.
    """
    bins: list[list[T]] = []
    loads: list[int] = []
    for item in sorted(items, key=lambda x: (-size(x), order(x))):
        n = size(item)
        for i, load in enumerate(loads):
            if load + n <= budget:
                bins[i].append(item)
                loads[i] += n
                break
        else:
            bins.append([item])
            loads.append(n)
    return bins

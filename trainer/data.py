"""From batch samples to model inputs: minibatch and rank splits, padding-free micro-batches.

A micro-batch packs several sequences into one row with position ids restarting at 0 for
each sequence; transformers then builds a block-diagonal causal mask, so no token attends
across sequences and no compute goes to padding. Only the positions that predict a
completion token are projected onto the vocabulary (`logits_to_keep`). Every split here is
deterministic and independent of the number of ranks, so one process and several produce
the same update up to float summation order.

Turns of one session share their tokens: the server extends a session's prompt token-exactly,
so turn k's prompt and reply are the first tokens of turn k+1's prompt. Such a sample rides
in the row of the longer one (`share_prefixes`): one forward pass over turn k+1 scores turn
k's reply too, at the very positions and with the very context its own pass would have had.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from liveloop.contracts import BatchSample
from liveloop.samples import first_fit_decreasing

if TYPE_CHECKING:
    import torch


def balanced_split(samples: Sequence[BatchSample], parts: int) -> list[list[BatchSample]]:
    """Split into `parts` lists of similar token totals (longest first onto the lightest).

    Ties go to the lowest index, and samples are ordered by (tokens, key) first, so the
    result depends only on the samples, never on arrival order.
    """
    ordered = sorted(samples, key=lambda s: (-s.num_tokens, s.key))
    bins: list[list[BatchSample]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for sample in ordered:
        target = min(range(parts), key=lambda i: (loads[i], i))
        bins[target].append(sample)
        loads[target] += sample.num_tokens
    return bins


@dataclass
class MicroBatch:
    """Sequences packed into one row, plus what the loss needs for their completion tokens."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    logit_index: torch.Tensor  # [N] row positions whose logits predict a completion token
    targets: torch.Tensor  # [N] the completion tokens
    logprobs: torch.Tensor  # [N] the behaviour log-probs recorded at serving (`logprobs`)
    advantages: torch.Tensor  # [N] the sample's advantage, per token
    signal: torch.Tensor  # [N] the objective's per-token signal (0 where a sample has none)
    signal_mask: torch.Tensor  # [N] 1.0 where the token has a signal, else 0.0
    num_tokens: int  # T: tokens in the forward pass
    num_samples: int
    # (completion tokens, oldest version) of each sample, in row order
    segments: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_targets(self) -> int:
        """Completion tokens in this micro-batch (the loss's token count)."""
        return int(self.targets.numel())


@dataclass(frozen=True)
class SharedRow:
    """Samples scored on one sequence: the longest, and those whose tokens begin it."""

    tokens: list[int]  # the longest sample's prompt + completion
    samples: tuple[BatchSample, ...]  # shortest first; the last one spans all of `tokens`

    @classmethod
    def of(cls, sample: BatchSample) -> SharedRow:
        """A row holding one sample alone."""
        return cls(sample.prompt_token_ids + sample.completion_token_ids, (sample,))

    @property
    def num_tokens(self) -> int:
        """Tokens in this row's forward pass."""
        return len(self.tokens)


def share_prefixes(samples: Sequence[BatchSample]) -> list[SharedRow]:
    """Rows in which every sample whose prompt + completion begins a longer one rides along.

    Longest first (ties by key), each sample joins the first row whose tokens start with all
    of its own, or starts a row. The result depends only on the samples.
    """
    members: list[list[BatchSample]] = []
    rows: list[list[int]] = []
    for sample in sorted(samples, key=lambda s: (-s.num_tokens, s.key)):
        seq = sample.prompt_token_ids + sample.completion_token_ids
        for i, row in enumerate(rows):
            if row[: len(seq)] == seq:
                members[i].append(sample)
                break
        else:
            rows.append(seq)
            members.append([sample])
    return [SharedRow(row, tuple(reversed(m))) for row, m in zip(rows, members, strict=True)]


def pack_bins(samples: Sequence[BatchSample], max_tokens: int) -> list[list[BatchSample]]:
    """First-fit decreasing into bins of at most `max_tokens` (a longer sample gets its own)."""
    return first_fit_decreasing(samples, lambda s: s.num_tokens, max_tokens, lambda s: s.key)


class _Columns:
    """The per-token columns of a micro-batch, filled sample by sample."""

    def __init__(self, signal: Mapping[str, Sequence[float]]) -> None:
        self.signal = signal
        self.logit_index: list[int] = []
        self.targets: list[int] = []
        self.logprobs: list[float] = []
        self.advantages: list[float] = []
        self.signal_values: list[float] = []
        self.signal_mask: list[float] = []
        self.segments: list[tuple[int, int]] = []

    def add(self, sample: BatchSample, row_start: int) -> None:
        """A sample whose tokens start at `row_start` in the packed row."""
        n = len(sample.completion_token_ids)
        first = row_start + len(sample.prompt_token_ids) - 1  # logits here predict completion[0]
        self.logit_index += range(first, first + n)
        self.targets += sample.completion_token_ids
        self.logprobs += sample.logprobs
        self.advantages += [sample.advantage] * n
        given = self.signal.get(sample.key)
        self.signal_values += list(given) if given is not None else [0.0] * n
        self.signal_mask += [1.0 if given is not None else 0.0] * n
        self.segments.append((n, sample.min_version))


def pack_rows(
    rows: Sequence[SharedRow],
    device: str = "cpu",
    signal: Mapping[str, Sequence[float]] | None = None,
) -> MicroBatch:
    """Pack rows into one micro-batch (positions restarting at 0 for each row).

    `signal` maps a sample key to the objective's values for it (one per completion token).
    """
    import torch

    ids: list[int] = []
    positions: list[int] = []
    columns = _Columns(signal or {})
    for row in rows:
        start = len(ids)
        ids += row.tokens
        positions += range(len(row.tokens))
        for sample in row.samples:
            columns.add(sample, start)

    def tensor(values: Sequence[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return MicroBatch(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        logit_index=tensor(columns.logit_index, torch.long),
        targets=tensor(columns.targets, torch.long),
        logprobs=tensor(columns.logprobs),
        advantages=tensor(columns.advantages),
        signal=tensor(columns.signal_values),
        signal_mask=tensor(columns.signal_mask),
        num_tokens=len(ids),
        num_samples=sum(len(row.samples) for row in rows),
        segments=columns.segments,
    )


def build_micro_batch(
    samples: Sequence[BatchSample],
    device: str = "cpu",
    signal: Mapping[str, Sequence[float]] | None = None,
) -> MicroBatch:
    """Pack samples into one row, each its own sequence (prompt + completion)."""
    return pack_rows([SharedRow.of(s) for s in samples], device, signal)


def micro_batches(
    samples: Sequence[BatchSample],
    max_tokens: int,
    device: str = "cpu",
    signal: Mapping[str, Sequence[float]] | None = None,
    *,
    share: bool = True,
) -> list[MicroBatch]:
    """The micro-batches of one rank's share of a minibatch (`share`: prefixes shared)."""
    rows = share_prefixes(samples) if share else [SharedRow.of(s) for s in samples]
    bins = first_fit_decreasing(
        rows, lambda r: r.num_tokens, max_tokens, lambda r: r.samples[-1].key
    )
    return [pack_rows(b, device, signal) for b in bins]

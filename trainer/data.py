"""From batch samples to model inputs: minibatch and rank splits, padding-free micro-batches.

A micro-batch packs several sequences into one row with position ids restarting at 0 for
each sequence; transformers then builds a block-diagonal causal mask, so no token attends
across sequences and no compute goes to padding. Only the positions that predict a
completion token are projected onto the vocabulary (`logits_to_keep`). Every split here is
deterministic and independent of the number of ranks, so one process and several produce
the same update up to float summation order.
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
    teacher: torch.Tensor  # [N] OPD teacher log-probs (0 where the sample has none)
    opd_mask: torch.Tensor  # [N] 1.0 where the token has a teacher log-prob, else 0.0
    num_tokens: int  # T: tokens in the forward pass
    num_samples: int
    # (completion tokens, oldest version) of each sample, in row order
    segments: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_targets(self) -> int:
        """Completion tokens in this micro-batch (the loss's token count)."""
        return int(self.targets.numel())


def pack_bins(samples: Sequence[BatchSample], max_tokens: int) -> list[list[BatchSample]]:
    """First-fit decreasing into bins of at most `max_tokens` (a longer sample gets its own)."""
    return first_fit_decreasing(samples, lambda s: s.num_tokens, max_tokens, lambda s: s.key)


def build_micro_batch(
    samples: Sequence[BatchSample],
    device: str = "cpu",
    teacher: Mapping[str, Sequence[float]] | None = None,
) -> MicroBatch:
    """Pack samples into one row (prompt + completion each, positions restarting at 0).

    `teacher` maps a sample key to its OPD teacher log-probs (one per completion token).
    """
    import torch

    teacher = teacher or {}
    ids: list[int] = []
    positions: list[int] = []
    logit_index: list[int] = []
    targets: list[int] = []
    logprobs: list[float] = []
    advantages: list[float] = []
    teacher_lp: list[float] = []
    opd_mask: list[float] = []
    segments: list[tuple[int, int]] = []
    for sample in samples:
        start = len(ids)
        seq = sample.prompt_token_ids + sample.completion_token_ids
        ids += seq
        positions += range(len(seq))
        first = start + len(sample.prompt_token_ids) - 1  # logits here predict completion[0]
        logit_index += range(first, first + len(sample.completion_token_ids))
        targets += sample.completion_token_ids
        logprobs += sample.logprobs
        n = len(sample.completion_token_ids)
        advantages += [sample.advantage] * n
        taught = teacher.get(sample.key)
        teacher_lp += list(taught) if taught is not None else [0.0] * n
        opd_mask += [1.0 if taught is not None else 0.0] * n
        segments.append((n, sample.min_version))
    return MicroBatch(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        logit_index=torch.tensor(logit_index, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
        logprobs=torch.tensor(logprobs, dtype=torch.float32, device=device),
        advantages=torch.tensor(advantages, dtype=torch.float32, device=device),
        teacher=torch.tensor(teacher_lp, dtype=torch.float32, device=device),
        opd_mask=torch.tensor(opd_mask, dtype=torch.float32, device=device),
        num_tokens=len(ids),
        num_samples=len(samples),
        segments=segments,
    )


def micro_batches(
    samples: Sequence[BatchSample],
    max_tokens: int,
    device: str = "cpu",
    teacher: Mapping[str, Sequence[float]] | None = None,
) -> list[MicroBatch]:
    """The micro-batches of one rank's share of a minibatch."""
    return [build_micro_batch(b, device, teacher) for b in pack_bins(samples, max_tokens)]

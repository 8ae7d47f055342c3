"""A toy training objective that lives in the test tree, loaded by import path like a user's.

`Briefer` pushes every sampled token down by `options.push` (default 1.0), whatever the
score: replies trained with it become less likely, which a test can see after one step. It
keeps only samples whose reply is at least `options.min_tokens` long and reports how many
tokens it pushed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from liveloop.contracts import BatchSample
from liveloop.trainer.objectives import (
    Objective,
    ObjectiveContext,
    ObjectiveReport,
    Tally,
    TokenInputs,
)

if TYPE_CHECKING:
    import torch


class Briefer(Objective):
    """Every token of every kept reply gets the advantage -push."""

    name = "briefer"

    def __init__(self, context: ObjectiveContext) -> None:
        super().__init__(context)
        self.push = float(context.options.get("push", 1.0))
        self.min_tokens = int(context.options.get("min_tokens", 1))
        self.tally = Tally(sums=("pushed_tokens",))

    def rejects(self, sample: BatchSample) -> str | None:
        return "too_short" if len(sample.completion_token_ids) < self.min_tokens else None

    def advantages(self, tokens: TokenInputs) -> torch.Tensor:
        self.tally.add("pushed_tokens", float(tokens.scalar.numel()))
        return -self.push * tokens.scalar.detach().abs().clamp(min=1.0).sign()

    def report(self, sums: dict[str, float], maxima: dict[str, float]) -> ObjectiveReport:
        return ObjectiveReport({"briefer_tokens": sums["pushed_tokens"]}, "briefer: pushed down")


class NotAnObjective:
    """Something importable that is not an objective."""

"""`rl`: the judged score is the advantage of every token of the reply."""

from __future__ import annotations

from typing import TYPE_CHECKING

from liveloop.trainer.objectives.base import Objective, TokenInputs

if TYPE_CHECKING:
    import torch

    from liveloop.contracts import BatchSample

FLAT_ADVANTAGE = 1e-6  # below this a sample's advantage is zero (a float's rounding of it)


class RLObjective(Objective):
    """Reward only: the collector's advantage (group-normalised or against a running baseline)
    applies to every token of the reply; directive hints are ignored."""

    name = "rl"

    def rejects(self, sample: BatchSample) -> str | None:
        """A sample without reward signal, when `trainer.skip_flat_samples` is on."""
        flat = abs(sample.advantage) < FLAT_ADVANTAGE
        return "flat" if flat and self.context.trainer.skip_flat_samples else None

    def advantages(self, tokens: TokenInputs) -> torch.Tensor:
        """The scalar advantage, per token."""
        return tokens.scalar.detach()

"""`rl`: the judged score is the advantage of every token of the reply."""

from __future__ import annotations

from typing import TYPE_CHECKING

from liveloop.trainer.objectives.base import Objective, TokenInputs

if TYPE_CHECKING:
    import torch


class RLObjective(Objective):
    """Reward only: the collector's advantage (group-normalised or against a running baseline)
    applies to every token of the reply; directive hints are ignored."""

    name = "rl"

    def advantages(self, tokens: TokenInputs) -> torch.Tensor:
        """The scalar advantage, per token."""
        return tokens.scalar.detach()

"""`combine`: the reward and the distillation signal, weighted, in one advantage per token.

    A_t = rl_weight * A_reward + opd_weight * clip(log pi_teacher(a_t | s + hint) - log pi_proximal(a_t | s))

Turns without a directive hint learn from the reward alone (their distillation term is 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from liveloop.config.opd import OPDSettings
from liveloop.contracts import BatchSample
from liveloop.trainer.objectives.base import TokenInputs
from liveloop.trainer.objectives.opd import OPDObjective, distillation_advantages

if TYPE_CHECKING:
    import torch


def combined_advantages(
    tokens: TokenInputs, cfg: OPDSettings, distilled: torch.Tensor | None = None
) -> torch.Tensor:
    """`rl_weight` x the scalar advantage + the distillation advantage (`distilled`, when
    already computed), per token."""
    if distilled is None:
        distilled = distillation_advantages(tokens, cfg)
    return cfg.rl_weight * tokens.scalar.detach() + distilled


class CombineObjective(OPDObjective):
    """Reward for every turn, plus the teacher's signal where a hint says more."""

    name = "combine"

    def rejects(self, sample: BatchSample) -> str | None:
        """Every turn has a reward to learn from."""
        return None

    def advantages(self, tokens: TokenInputs) -> torch.Tensor:
        """The combined advantage, with the distillation statistics tallied."""
        opd = distillation_advantages(tokens, self.cfg)
        self._tally_taught(tokens, opd)
        return combined_advantages(tokens, self.cfg, opd)

"""The seam every training objective plugs into: what it needs, keeps, computes and reports.

The decoupled PPO update (`liveloop.trainer.ppo`) is the same for every objective; what an
objective decides is each completion token's advantage. An objective may need the frozen
reference weights loaded (`needs`), may refuse samples it cannot learn from (`rejects`), may
compute a per-token signal for the batch before the first optimizer step (`prepare`: a
teacher's log-probs, say), turns that signal and the proximal log-probs into advantages,
micro-batch by micro-batch (`advantages`), may measure something after the steps
(`after_steps`), and reports its own statistics (`report`). The update sums every objective's
tally across data-parallel ranks without knowing what it holds.

A new objective is one subclass in one file, registered in `liveloop.trainer.objectives`
(or named by `trainer.objective = {kind = "custom", import_path = "pkg.mod:Class"}`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from liveloop.config.trainer import TrainerConfig
from liveloop.contracts import BatchSample

if TYPE_CHECKING:
    import torch

    from liveloop.trainer.policy import Policy

# Per-sample token signal, by sample key: one value per completion token.
TokenSignal = dict[str, list[float]]


@dataclass(frozen=True)
class Needs:
    """What the trainer must load for an objective before it is built."""

    reference: bool = False  # the frozen initial weights (LoRA: the base with adapters off)


@dataclass(frozen=True)
class ObjectiveContext:
    """What an objective is built with: the policy it trains and the trainer's settings."""

    policy: Policy
    trainer: TrainerConfig
    model_name: str
    options: dict[str, Any] = field(default_factory=dict)  # a custom objective's own settings
    # What outlives one build: the trainer rebuilds its objective whenever it reloads the
    # policy (a refusal, a rollback), and a teacher model is loaded only once.
    cache: dict[str, Any] = field(default_factory=dict)
    tool_result_reminder: str = ""  # what the server puts after tool results in a prompt


@dataclass(frozen=True)
class TokenInputs:
    """One micro-batch's completion tokens, as an objective sees them (all 1-D, row order)."""

    scalar: torch.Tensor  # the judged score's advantage (the collector's), per token
    proximal: torch.Tensor  # log-probs under the weights before the update (no grad)
    signal: torch.Tensor  # the objective's prepared signal, 0 where a sample has none
    signal_mask: torch.Tensor  # 1.0 where the token has a prepared signal, else 0.0
    lengths: list[int]  # completion tokens of each reply, in row order


@dataclass(frozen=True)
class ObjectiveReport:
    """An objective's statistics of one update: flat metrics and a note for the log line."""

    metrics: dict[str, float] = field(default_factory=dict)
    note: str = ""


class Tally:
    """Named running sums (and maxima) of one update, with the same keys on every rank."""

    def __init__(self, sums: Iterable[str] = (), maxima: Iterable[str] = ()) -> None:
        self.sums = dict.fromkeys(sums, 0.0)
        self.maxima = dict.fromkeys(maxima, 0.0)

    def add(self, key: str, value: float) -> None:
        """Add to a declared sum (KeyError for an undeclared one: ranks must agree)."""
        self.sums[key] += value

    def peak(self, key: str, value: float) -> None:
        """Raise a declared maximum."""
        self.maxima[key] = max(self.maxima[key], value)

    def reset(self) -> None:
        """Zero everything, for the next update."""
        self.sums = dict.fromkeys(self.sums, 0.0)
        self.maxima = dict.fromkeys(self.maxima, 0.0)


class Objective(ABC):
    """A training objective: per-token advantages inside the decoupled PPO loss."""

    name: ClassVar[str]

    def __init__(self, context: ObjectiveContext) -> None:
        self.context = context
        self.tally = Tally()

    @classmethod
    def needs(cls, cfg: TrainerConfig) -> Needs:
        """What must be loaded before the objective is built (nothing by default)."""
        return Needs()

    def rejects(self, sample: BatchSample) -> str | None:
        """Why a sample cannot be trained under this objective (a metric label), or None."""
        return None

    def prepare(self, samples: list[BatchSample]) -> TokenSignal:
        """Per-token signal of this rank's samples, before any optimizer step (none here)."""
        return {}

    @abstractmethod
    def advantages(self, tokens: TokenInputs) -> torch.Tensor:
        """Each token's advantage (no gradient) for one micro-batch."""

    def after_steps(self, samples: list[BatchSample], signal: TokenSignal) -> None:
        """Measure what the optimizer steps did (this rank's samples); nothing by default."""
        return None

    def report(self, sums: dict[str, float], maxima: dict[str, float]) -> ObjectiveReport:
        """Statistics of the update from the tally summed (and maxed) over every rank."""
        return ObjectiveReport()

    def close(self) -> None:
        """Release what the objective holds (a teacher's HTTP client, threads)."""
        return None

"""What the safeguards decide and the training loop carries out.

After each update the promotion gate says *serve* or *refuse*; between updates the
served-quality watch may say *roll back to version N*. A `Decision` carries everything the
loop needs to apply one: the version's status, the weights training goes on from, the
learning-rate scale of the next update, and the checkpoints that must survive pruning. The
loop never looks at gate or watch settings to work these out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from liveloop.contracts import VersionStatus

if TYPE_CHECKING:
    from liveloop.trainer.safeguards.probing import ProbeResult


class Verdict(StrEnum):
    """What happens to a version."""

    SERVE = "serve"  # announce it as servable
    REFUSE = "refuse"  # announce it as rejected: never served
    ROLL_BACK = "roll_back"  # serve an earlier version's weights again, as a new version


@dataclass(frozen=True)
class Rollback:
    """Go back to `target`'s weights: `culprit` served worse, and so may its successors."""

    target: int
    culprit: int
    abandoned: list[int]  # every live version not yet judged good, the culprit among them
    reason: str

    def reasons(self, new_version: int) -> dict[int, str]:
        """What the registry says of each abandoned version, once `new_version` replaced it."""
        rolled = f"rolled back to v{self.target} as v{new_version}"
        return {v: self._why(v, rolled) for v in self.abandoned}

    def _why(self, version: int, rolled: str) -> str:
        if version == self.culprit:
            return f"{self.reason}; {rolled}"
        order = "after" if version > self.culprit else "before"
        return f"went live {order} v{self.culprit}, {rolled} with it"


@dataclass(frozen=True)
class Decision:
    """A decision about `version`, and how the trainer goes on after it."""

    verdict: Verdict
    version: int  # the version decided about (a candidate, or a rollback's culprit)
    resume_from: int  # the version whose weights (and optimizer state) training goes on from
    lr_scale: float  # of the configured learning rate, for the next update
    protect: frozenset[int] = frozenset()  # checkpoints pruning must keep
    reason: str | None = None
    probe: ProbeResult | None = None  # the gate's probe of the candidate
    rollback: Rollback | None = field(default=None)  # ROLL_BACK: what falls and why

    @property
    def status(self) -> VersionStatus:
        """The status a candidate is recorded and announced with."""
        return VersionStatus.REJECTED if self.verdict is Verdict.REFUSE else VersionStatus.ACCEPTED

"""The served-quality watch: a version whose served turns went bad is rolled back.

The promotion gate decides on a few probe replies before a version is served, and it can
miss a version that then serves hundreds of bad replies. Every version's judged served
turns are counted per version in Redis (`liveloop.quality`), so the trainer can look back:
once a live version has `min_turns` judged turns, its mean served reward is compared with
the turns of the last few versions that passed this check, taken together (not with the
best of them: the best of a few noisy means is high by luck). If it is lower by more than
a margin *and* by more than `z` standard errors of the difference (a plain two-sample z
test, so a few unlucky turns do not trigger it), `ServedWatch.check` returns a `Rollback`:
the trainer loads the newest good version's weights and publishes them under a new version
number (servers only ever move forward), and the bad version and the versions trained
from it are marked `rolled_back` in the registry.

The watch remembers the versions in the order they went live, and keeps the checkpoints of
the good ones it compares with. A version whose checkpoint was pruned before it had enough
turns counts in the comparison but cannot be gone back to. A version replaced before it had
`min_turns` judged turns is skipped once a later one is ready; one that had them, but whose
served tokens are not all measured yet, is judged on its turns. The reward check does not
wait for those tokens either: the trainer measures them only when it trains on them (three
or four versions later in a demo), so a version whose served reward fell is rolled back as
soon as its turns show it, with the versions that went live since. Until its tokens are in,
the same version's reward is compared again at every look (as its turns grow), which makes
a needless rollback a little likelier than the single test's `z` says. After a restart the watch
starts again from the current version's ancestors whose checkpoints are still on disk.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from liveloop.config.watch import WatchSettings
from liveloop.quality import VersionQuality
from liveloop.trainer.checkpoints import CheckpointStore, TrainerState

MAX_PENDING = 32  # live versions awaiting their turns (when none is ever judged, the oldest go)
log = logging.getLogger(__name__)

NOWHERE = -1  # a Rollback's target when no good version's checkpoint is left
UNKNOWN_SD = 1.0  # counters written before the sum of squares was kept: assume a wide spread


@dataclass(frozen=True)
class Served:
    """One version's judged served turns: how many, their mean score and its spread."""

    version: int
    judged: int
    mean: float
    sd: float

    @classmethod
    def of(cls, quality: VersionQuality) -> Served:
        """From a version's counters (which must have a mean reward)."""
        assert quality.mean_reward is not None
        sd = quality.reward_sd if quality.reward_sd is not None else UNKNOWN_SD
        return cls(quality.version, quality.judged, quality.mean_reward, sd)

    def describe(self) -> str:
        """E.g. 'v3 -0.750 over 24 turns'."""
        return f"v{self.version} {self.mean:+.3f} over {self.judged} turns"


def pooled(group: Iterable[Served]) -> tuple[float, float, int]:
    """Mean, standard deviation and count of the turns of several versions taken together."""
    items = list(group)
    count = sum(s.judged for s in items)
    mean = sum(s.mean * s.judged for s in items) / count
    squares = sum((s.judged - 1) * s.sd**2 + s.judged * s.mean**2 for s in items)
    return mean, math.sqrt(max(squares - count * mean**2, 0.0) / max(count - 1, 1)), count


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


class ServedWatch:
    """Compares each live version's served reward with the recent good versions' together."""

    def __init__(
        self,
        cfg: WatchSettings,
        lineage: Iterable[int],
        loadable: Callable[[int], bool],
        *,
        drift: bool = False,
    ) -> None:
        self.cfg = cfg
        self.loadable = loadable  # whether a version's weights are still there to go back to
        # The reference-NLL bound: only where served drift is measured and means something.
        self.max_nll_ratio = cfg.max_nll_ratio if drift else None
        self.version0_nll: float | None = None
        self.pending: list[int] = list(lineage)  # live versions not checked yet, oldest first
        self.good: deque[Served] = deque(maxlen=cfg.lookback)
        self.rollbacks = 0

    @classmethod
    def resume(
        cls, cfg: WatchSettings, store: CheckpointStore, state: TrainerState, *, drift: bool
    ) -> ServedWatch:
        """A watch of the current version and its last few ancestors still on disk."""

        def loadable(version: int) -> bool:  # version 0 is the base model
            return version == 0 or version in store.versions()

        chain, parent = [state.version], state.parent
        while parent is not None and len(chain) <= cfg.lookback and loadable(parent):
            chain.append(parent)
            parent = store.load_state(parent).parent if parent else None
        return cls(cfg, reversed(chain), loadable, drift=drift)

    def went_live(self, version: int) -> None:
        """A new version is being served (accepted by the gate, or there is no gate)."""
        self.pending = [*self.pending, version][-MAX_PENDING:]

    def keep(self) -> frozenset[int]:
        """Checkpoints to keep on disk: the good versions, to go back to, and the next few to
        be checked (a version is judged good only after its turns, by when the trainer has
        written several newer checkpoints)."""
        return frozenset(s.version for s in self.good) | frozenset(
            self.pending[: self.cfg.lookback]
        )

    def wanted(self) -> list[int]:
        """The versions whose served counters `check` needs: the pending ones, and 0."""
        return sorted({0, *self.pending})

    def check(self, served: dict[int, VersionQuality]) -> Rollback | None:
        """Check the pending versions, oldest first, as far as their turns allow."""
        base = served.get(0)
        if base is not None and self._measured(base):
            self.version0_nll = base.ref_nll
        while self.pending:
            version = self.pending[0]
            quality = served.get(version)
            if not self._settled(quality):
                if not any(self._settled(served.get(v)) for v in self.pending[1:]):
                    return self._fell_early(served)
                if quality is None or not self._enough_turns(quality):
                    log.info("watch: v%d skipped, a later version is ready first: %s",
                             version, _short(quality))  # fmt: skip
                    self.pending.pop(0)  # replaced before it served enough turns to judge
                    continue
                # Enough turns, not all its tokens measured yet: judged on what it has.
            assert quality is not None
            candidate = Served.of(quality)
            rollback = self._compare(candidate) or self._drifted(quality)
            if rollback is not None and rollback.target != NOWHERE:
                return rollback
            if rollback is None:
                log.info("watch: v%d good: %s", version, _short(quality))
                self.good.append(candidate)
            else:  # it fell, and no good version's checkpoint is left to go back to
                log.warning("cannot roll back (no good checkpoint left): %s", rollback.reason)
            self.pending.pop(0)
        return None

    def _fell_early(self, served: dict[int, VersionQuality]) -> Rollback | None:
        """A rollback for a pending version whose served reward already fell, before its
        tokens are measured (the trainer measures them only when it trains on them, a few
        versions later): a reward check need not wait for the NLL check."""
        for version in self.pending:
            quality = served.get(version)
            if quality is None or not self._enough_turns(quality):
                continue
            rollback = self._compare(Served.of(quality))
            if rollback is not None and rollback.target != NOWHERE:
                return rollback
        return None

    def rolled_back(self, new_version: int) -> None:
        """The target's weights are live again as `new_version`; forget the abandoned ones."""
        self.pending = [new_version]
        self.rollbacks += 1

    def _measured(self, quality: VersionQuality) -> bool:
        """Its served replies' reference NLL is read over enough of them: `min_ref_tokens`
        tokens, or `min_turns` replies (short replies may never add up to the tokens)."""
        enough = (
            quality.ref_tokens >= self.cfg.min_ref_tokens
            or quality.ref_replies >= self.cfg.min_turns
        )
        return quality.ref_nll is not None and enough

    def _enough_turns(self, quality: VersionQuality) -> bool:
        return quality.mean_reward is not None and quality.judged >= self.cfg.min_turns

    def _settled(self, quality: VersionQuality | None) -> bool:
        """Enough judged turns (and, with the NLL bound, measured served tokens) to compare."""
        return (
            quality is not None
            and self._enough_turns(quality)
            and (self.max_nll_ratio is None or quality.version == 0 or self._measured(quality))
        )

    def _drifted(self, quality: VersionQuality) -> Rollback | None:
        """A rollback if the version's served replies became unnatural to the reference
        (measured over `min_ref_tokens` or `min_turns` replies: a few tokens say little)."""
        bound, base, nll = self.max_nll_ratio, self.version0_nll, quality.ref_nll
        if bound is None or base is None or nll is None or not self._measured(quality):
            return None
        if nll <= bound * base:
            return None
        reason = (
            f"reference NLL of v{quality.version}'s served replies {nll:.3f} per token (over "
            f"{quality.ref_tokens} tokens) > {bound:g} x version 0's {base:.3f}"
        )
        return Rollback(self._target(), quality.version, list(self.pending), reason)

    def _compare(self, candidate: Served) -> Rollback | None:
        """A rollback to the newest good version still on disk, if the candidate fell."""
        if not self.good:
            return None
        mean, sd, count = pooled(self.good)
        gap = mean - candidate.mean
        error = math.sqrt(sd**2 / count + candidate.sd**2 / candidate.judged)
        z = gap / error if error > 0 else math.inf if gap > 0 else 0.0
        if gap <= self.cfg.reward_margin or z <= self.cfg.z:
            return None
        names = ", ".join(f"v{s.version}" for s in self.good)
        reason = (
            f"served reward {candidate.describe()} is below the last good versions' "
            f"({names}: {mean:+.3f} over {count} turns) by {gap:.3f} (> "
            f"{self.cfg.reward_margin:g}, and {z:.1f} > {self.cfg.z:g} standard errors)"
        )
        return Rollback(self._target(), candidate.version, list(self.pending), reason)

    def _target(self) -> int:
        """The newest good version still on disk, or NOWHERE."""
        loadable = [s.version for s in self.good if self.loadable(s.version)]
        return loadable[-1] if loadable else NOWHERE


def _short(quality: VersionQuality | None) -> str:
    """A version's counters in a log line."""
    if quality is None:
        return "no turns"
    nll = "-" if quality.ref_nll is None else f"{quality.ref_nll:.3f}"
    reward = "-" if quality.mean_reward is None else f"{quality.mean_reward:+.3f}"
    return (
        f"{quality.judged} judged, reward {reward}, ref NLL {nll} over {quality.ref_tokens} tokens"
    )

"""The served-quality watch: a version whose served turns went bad is rolled back.

The promotion gate decides on a few probe replies before a version is served, and it can
miss a version that then serves hundreds of bad replies. Every version's judged served
turns are counted per version in Redis (`liveloop.quality`), so the trainer can look back:
once a live version has `min_turns` judged turns, its mean served reward is compared with
the turns of the last few versions judged good, taken together (not with the best of them:
the best of a few noisy means is high by luck). If it is lower by more than a margin *and*
by more than `z` standard errors of the difference (a plain two-sample z test, so a few
unlucky turns do not trigger it), `ServedWatch.check` returns a `Rollback` to the newest
good version whose checkpoint is still on disk; the versions that went live since it are
abandoned with the culprit. Where the trainer measures served drift (a model with
language), a version whose served replies' reference NLL per token exceeds
`max_nll_ratio` times version 0's is rolled back too.

Each live version moves through explicit stages (`Stage`): waiting for its turns; its turns
in (enough judged turns, its served tokens not all measured yet: the trainer measures them
only when it trains on them, a few versions later); measured; and finally judged good,
bad, or skipped. The reward check does not wait for the measurement: a version whose turns
show a fall is rolled back as soon as they do. A version with its turns in is judged on
them alone once a later version is measured, and one still waiting for its turns then is
skipped (it was replaced before it served enough to judge), except version 0: a tenant's base
serves that tenant only until its first adapter, often fewer than `min_turns` turns, so with
`min_base_turns` it becomes the baseline once the later versions have `min_turns` (the z
test weighs how few they are). Versions replaced that fast
would never be looked at (a tenant's adapter, which serves one tenant's traffic, often
serves fewer than `min_turns` turns before its next version): so the newest live versions
are also compared together, as one, as soon as their turns add up to `min_turns`, and a
fall of theirs rolls back to the newest good version like a single version's would (they
are not judged good together; each still waits for its own turns). Until a version is measured,
its reward is compared again at every look (as its turns grow), which makes a needless
rollback a little likelier than the single test's `z` says. After a restart the watch
starts again from the current version's ancestors whose checkpoints are still on disk.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

from liveloop.config.watch import WatchSettings
from liveloop.quality import VersionQuality
from liveloop.trainer.checkpoints import CheckpointStore, TrainerState
from liveloop.trainer.safeguards.decisions import Rollback

MAX_PENDING = 32  # live versions awaiting a verdict (when none is ever judged, the oldest go)
log = logging.getLogger(__name__)

UNKNOWN_SD = 1.0  # counters written before the sum of squares was kept: assume a wide spread


class Stage(StrEnum):
    """Where a live version stands with the watch."""

    WAITING = "waiting for turns"  # fewer than min_turns judged turns
    TURNS_IN = "turns in"  # enough judged turns; its served tokens not measured yet
    MEASURED = "measured"  # enough judged turns and measured tokens: ready to judge
    GOOD = "judged good"
    BAD = "judged bad"  # fell, but no good checkpoint was left to go back to
    SKIPPED = "skipped"  # replaced before it served enough turns to judge


@dataclass
class Watched:
    """A live version the watch follows, and its stage."""

    version: int
    stage: Stage = Stage.WAITING
    quality: VersionQuality | None = None


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


class ServedWatch:
    """Compares each live version's served reward with the recent good versions' together."""

    def __init__(
        self,
        cfg: WatchSettings,
        lineage: Iterable[int],
        loadable: Callable[[int], bool],
        *,
        drift: bool = False,
        whose: str = "",
    ) -> None:
        self.cfg = cfg
        self.whose = whose  # " of tenant <id>" in tenant scope, for log lines
        self.loadable = loadable  # whether a version's weights are still there to go back to
        # The reference-NLL bound: only where served drift is measured and means something.
        self.max_nll_ratio = cfg.max_nll_ratio if drift else None
        self.version0_nll: float | None = None
        self.live: list[Watched] = [Watched(v) for v in lineage]  # awaiting a verdict, oldest first
        self.good: deque[Served] = deque(maxlen=cfg.lookback)
        self.rollbacks = 0

    @classmethod
    def resume(
        cls,
        cfg: WatchSettings,
        store: CheckpointStore,
        state: TrainerState,
        *,
        drift: bool,
        whose: str = "",
    ) -> ServedWatch:
        """A watch of the current version and its last few ancestors still on disk."""

        def loadable(version: int) -> bool:  # version 0 is the base model
            return version == 0 or version in store.versions()

        chain, parent = [state.version], state.parent
        while parent is not None and len(chain) <= cfg.lookback and loadable(parent):
            chain.append(parent)
            parent = store.load_state(parent).parent if parent else None
        return cls(cfg, reversed(chain), loadable, drift=drift, whose=whose)

    @property
    def pending(self) -> list[int]:
        """Live versions awaiting a verdict, oldest first."""
        return [w.version for w in self.live]

    def stages(self) -> dict[int, Stage]:
        """The stage of every version awaiting a verdict."""
        return {w.version: w.stage for w in self.live}

    def went_live(self, version: int) -> None:
        """A new version is being served (accepted by the gate, or there is no gate)."""
        self.live = [*self.live, Watched(version)][-MAX_PENDING:]

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

    def rolled_back(self, new_version: int) -> None:
        """The target's weights are live again as `new_version`; forget the abandoned ones."""
        self.live = [Watched(new_version)]
        self.rollbacks += 1

    def check(self, served: dict[int, VersionQuality]) -> Rollback | None:
        """Update every live version's stage from its counters, then judge them, oldest
        first, as far as their stages allow; a Rollback when one fell."""
        base = served.get(0)
        if base is not None and self._measured(base):
            self.version0_nll = base.ref_nll
        for watched in self.live:
            watched.quality = served.get(watched.version)
            watched.stage = self._stage(watched.quality)
        while self.live:
            watched = self.live[0]
            if self._base_taken_short(watched):
                continue
            later_ready = any(w.stage is Stage.MEASURED for w in self.live[1:])
            if watched.stage is Stage.WAITING and later_ready:
                self._settle(Stage.SKIPPED)
                continue
            if watched.stage is Stage.WAITING or (
                watched.stage is Stage.TURNS_IN and not later_ready
            ):
                return self._fell_early()  # wait for more turns or tokens
            rollback = self._judge(watched)
            if rollback is not None:
                return rollback
        return None

    def _base_taken_short(self, watched: Watched) -> bool:
        """Version 0, replaced before it had `min_turns` judged turns, becomes the baseline
        on `min_base_turns` once the later versions have `min_turns` (no more will come)."""
        quality = watched.quality
        if watched.version != 0 or quality is None or quality.mean_reward is None:
            return False
        short_base = (
            watched.stage is Stage.WAITING
            and not self.good
            and quality.judged >= self.cfg.min_base_turns
            and sum(w.quality.judged for w in self.live[1:] if w.quality) >= self.cfg.min_turns
        )
        if not short_base:
            return False
        log.info("watch: v0%s taken as the baseline on fewer than %d turns: %s",
                 self.whose, self.cfg.min_turns, _short(quality))  # fmt: skip
        self.good.append(Served.of(quality))
        self._settle(Stage.GOOD)
        return True

    def _stage(self, quality: VersionQuality | None) -> Stage:
        if quality is None or quality.mean_reward is None or quality.judged < self.cfg.min_turns:
            return Stage.WAITING
        bound = self.max_nll_ratio is not None and quality.version != 0
        return Stage.TURNS_IN if bound and not self._measured(quality) else Stage.MEASURED

    def _judge(self, watched: Watched) -> Rollback | None:
        """The verdict on the oldest live version (its turns in, or measured)."""
        assert watched.quality is not None
        candidate = Served.of(watched.quality)
        fell = self._compare(candidate) or self._drifted(watched.quality)
        if fell is None:
            unchecked = "" if self.good or watched.version == 0 else " (nothing to compare with)"
            log.info("watch: v%d%s good%s: %s",
                     watched.version, self.whose, unchecked, _short(watched.quality))  # fmt: skip
            self.good.append(candidate)
            self._settle(Stage.GOOD)
            return None
        rollback = self._rollback(watched.version, fell)
        if rollback is None:  # it fell, and no good version's checkpoint is left to go back to
            log.warning("cannot roll back (no good checkpoint left): %s", fell)
            self._settle(Stage.BAD)
        return rollback

    def _settle(self, stage: Stage) -> None:
        """The oldest live version has its verdict; it leaves the list."""
        watched = self.live.pop(0)
        if stage is Stage.SKIPPED:
            log.info("watch: v%d%s skipped, a later version is ready first: %s",
                     watched.version, self.whose, _short(watched.quality))  # fmt: skip

    def _fell_early(self) -> Rollback | None:
        """A rollback for a live version whose served reward already fell, before its
        tokens are measured: a reward check need not wait for the NLL check."""
        for watched in self.live:
            if watched.stage is Stage.WAITING or watched.quality is None:
                continue
            fell = self._compare(Served.of(watched.quality))
            rollback = self._rollback(watched.version, fell) if fell else None
            if rollback is not None:
                return rollback
        return self._newest_fell()

    def _newest_fell(self) -> Rollback | None:
        """A rollback when the newest live versions, none with `min_turns` judged turns of
        its own but together with that many, served worse than the good versions."""
        newest: list[Served] = []
        turns = 0
        for watched in reversed(self.live):
            quality = watched.quality
            if quality is not None and quality.mean_reward is not None and quality.judged:
                newest.insert(0, Served.of(quality))
                turns += quality.judged
            if turns >= self.cfg.min_turns:
                break
        else:
            return None  # too few turns yet, all of them together
        if len(newest) < 2:
            return None  # the newest version has enough of its own: compared alone
        mean, sd, count = pooled(newest)
        together = Served(newest[0].version, count, mean, sd)
        names = ", ".join(f"v{s.version}" for s in newest)
        fell = self._compare(together, f"of {names} together {mean:+.3f} over {count} turns")
        return self._rollback(newest[0].version, fell) if fell else None

    def _measured(self, quality: VersionQuality) -> bool:
        """Its served replies' reference NLL is read over enough of them: `min_ref_tokens`
        tokens, or `min_turns` replies (short replies may never add up to the tokens)."""
        enough = (
            quality.ref_tokens >= self.cfg.min_ref_tokens
            or quality.ref_replies >= self.cfg.min_turns
        )
        return quality.ref_nll is not None and enough

    def _drifted(self, quality: VersionQuality) -> str | None:
        """Why the version's served replies became unnatural to the reference (measured
        over `min_ref_tokens` or `min_turns` replies: a few tokens say little), or None."""
        bound, base, nll = self.max_nll_ratio, self.version0_nll, quality.ref_nll
        if bound is None or base is None or nll is None or not self._measured(quality):
            return None
        if nll <= bound * base:
            return None
        return (
            f"reference NLL of v{quality.version}'s served replies {nll:.3f} per token (over "
            f"{quality.ref_tokens} tokens) > {bound:g} x version 0's {base:.3f}"
        )

    def _compare(self, candidate: Served, described: str | None = None) -> str | None:
        """Why the candidate's served reward fell below the good versions', or None."""
        if not self.good:
            return None
        mean, sd, count = pooled(self.good)
        gap = mean - candidate.mean
        error = math.sqrt(sd**2 / count + candidate.sd**2 / candidate.judged)
        z = gap / error if error > 0 else math.inf if gap > 0 else 0.0
        if gap <= self.cfg.reward_margin or z <= self.cfg.z:
            return None
        names = ", ".join(f"v{s.version}" for s in self.good)
        return (
            f"served reward {described or candidate.describe()} is below the last good versions' "
            f"({names}: {mean:+.3f} over {count} turns) by {gap:.3f} (> "
            f"{self.cfg.reward_margin:g}, and {z:.1f} > {self.cfg.z:g} standard errors)"
        )

    def _rollback(self, culprit: int, reason: str) -> Rollback | None:
        """To the newest good version still on disk (None: there is none)."""
        loadable = [s.version for s in self.good if self.loadable(s.version)]
        if not loadable:
            return None
        return Rollback(loadable[-1], culprit, self.pending, reason)


def _short(quality: VersionQuality | None) -> str:
    """A version's counters in a log line."""
    if quality is None:
        return "no turns"
    nll = "-" if quality.ref_nll is None else f"{quality.ref_nll:.3f}"
    reward = "-" if quality.mean_reward is None else f"{quality.mean_reward:+.3f}"
    return (
        f"{quality.judged} judged, reward {reward}, ref NLL {nll} over {quality.ref_tokens} tokens"
    )

"""The promotion gate: a trained version is served only if it does not make things worse.

Reward alone can rise while replies decay, so before the trainer announces a version it
answers a probe set (drawn by a probe source, `liveloop.trainer.safeguards.sources`) with
the new weights, in the trainer's own process: serving never waits for it. The version is
refused when its judged probe reward falls below the serving version's (or version 0's) by
more than `reward_margin`, when its KL to the reference model exceeds `max_kl`, when its
replies' reference NLL per token exceeds `max_nll_ratio` times version 0's, or, for a model
with language, when fewer of its replies name the question's topic than version 0's by more
than `max_topic_drop`, when more of them are no answer at all (word salad, nonsense,
repeats) than version 0's by more than `max_nonsense_rise`, or when more than
`max_symbol_share` of them are dominated by symbols. A probe reply that calls an offered
tool is a call, not an answer, and those measures leave it out
(`ProbeResult.tool_call_share` counts it). A refused version is recorded and announced as
rejected (never served), and the trainer trains on from the last accepted version. A
candidate is only ever compared with versions probed on the same set: when a refreshing
source draws a new one, version 0 and the serving version are probed on it before the next
candidate, on the probes they have not answered only (each probe's reply is sampled with its
own seed, so a measured reply stands in any set). When the serving version is itself beyond
a drift bound on the new set, the source is asked for a second set (`second_draw`): until
the next draw, a candidate that the first set finds beyond a drift bound answers the second
set too, and the drift bounds decide on both sets together (reward is compared on the first
set, where the serving version's is known); with `second_set_for_candidates` the second set
is also drawn, and version 0 probed on it, at the first candidate the first set finds
beyond a drift bound. A candidate within the bounds costs one set. With no probes at all (no
traffic served yet) the gate has no evidence and accepts, saying so; a set drawn short
(fewer served requests than it wants) is drawn again (topped up) before the next update,
not `refresh_versions` later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry
from pydantic import BaseModel, Field

from liveloop.config import JudgeConfig, SharedSettings
from liveloop.config.defaults import model_defaults
from liveloop.config.gate import GateSettings
from liveloop.prm.judges.registry import load_judges
from liveloop.prm.metrics import PrmMetrics
from liveloop.prm.panel import JudgePanel
from liveloop.probe_sources import Probe, ProbeSource
from liveloop.sense import SenseCheck
from liveloop.tenants import of_tenant
from liveloop.trainer.policy import Policy
from liveloop.trainer.safeguards.bounds import drift_reasons, reward_reasons
from liveloop.trainer.safeguards.prefixes import ReferencePrompts, reference_weights
from liveloop.trainer.safeguards.probing import (
    Measured,
    ProbeResult,
    Sampled,
    joined,
    judge_replies,
    pieces,
    pooled,
    probe_seeds,
    render_prompts,
)
from liveloop.trainer.safeguards.sampling import sample_replies

log = logging.getLogger(__name__)

KEPT_RESULTS = 16  # probe results of recent live versions, for a rollback to compare with


class GateVerdict(BaseModel):
    """Whether a version may be served, why not, and what its probes showed."""

    accepted: bool
    reason: str | None = None
    probe: ProbeResult = Field(
        description="What the gate measured: both sets when it looked at both."
    )
    first: ProbeResult | None = Field(
        None, description="The version on the first set, where `probe` covers both sets."
    )

    @property
    def on_first_set(self) -> ProbeResult:
        """The version's result on the first set: what later candidates are compared with."""
        return self.first if self.first is not None else self.probe


def build_panel(judging: JudgeConfig, shared: SharedSettings) -> JudgePanel:
    """The configured judges, as the judging loop would build them (validated at start-up)."""
    judges = load_judges(judging.judges, judging, shared)
    return JudgePanel(judges, PrmMetrics(CollectorRegistry()), judging.judge_timeout_s)


class PromotionGate:
    """Probes a candidate's weights and decides whether it may replace the serving version."""

    def __init__(
        self,
        model: str,
        cfg: GateSettings,
        panel: JudgePanel,
        source: ProbeSource,
        sense: SenseCheck | None = None,
        *,
        tool_result_reminder: str = "",
    ) -> None:
        self.model = model
        self.tool_result_reminder = tool_result_reminder  # rendered into probes as served
        self.cfg = cfg
        self.panel = panel
        self.source = source
        self.sense = sense
        self.probes: list[Probe] = []
        self.more: list[Probe] = []  # the second set (`second_draw`), until the next draw
        self.drawn_at = 0  # the version the probe set was drawn at
        self.assessed = 0  # candidates since the draw (a tenant's gate: its own versions)
        defaults = model_defaults(model)
        self.max_tokens = self.cfg.max_tokens or defaults.reply_tokens
        self.max_kl = self.cfg.max_kl if self.cfg.max_kl is not None else defaults.gate_max_kl
        self.has_language = defaults.has_language  # else the topic and symbol rules are moot
        self.version0: ProbeResult | None = None
        self.serving: ProbeResult | None = None
        self.version0_both: ProbeResult | None = None  # version 0 on both sets, once drawn
        self._on_first: dict[int, Measured] = {}  # version 0 and the serving one, to pool
        self._live: dict[int, ProbeResult] = {}  # probes of recently accepted versions
        # rendered prompts and their sampling seeds, by "is the second set"
        self._prompts: dict[bool, tuple[list[list[int]], list[int]]] = {}
        # each probe's measures (by its seed) of version 0 and of the live versions: a set
        # drawn again is probed on them only where it holds probes they have not answered
        self._kept: dict[int, dict[int, Measured]] = {}
        self._candidate: tuple[int, dict[int, Measured]] = (-1, {})  # kept if it goes live
        self.reference_prompts = ReferencePrompts(cfg.reference_cache_mib)  # the probes' prompts

    def _rendered(self, policy: Policy, second: bool) -> tuple[list[list[int]], list[int]]:
        """The set's prompt ids, rendered as the server renders them, and their seeds."""
        if second not in self._prompts:
            probes = self.more if second else self.probes
            prompts = render_prompts(policy.tokenizer, probes, self.tool_result_reminder)
            self._prompts[second] = prompts, probe_seeds(self.cfg.seed, prompts)
        return self._prompts[second]

    def _sample(
        self, policy: Policy, version: int, weights: Any, prompts: list[list[int]], seeds: list[int]
    ) -> tuple[Sampled, list[Any]]:
        """Replies of `weights` (the reference's for version 0) and their reference log-probs
        (over the reference's kept keys and values of each prompt)."""
        if version == 0:
            with reference_weights(policy) as model:
                sampled = self._replies(model, policy.tokenizer, prompts, seeds)
            return sampled, sampled.logprobs
        sampled = self._replies(weights, policy.tokenizer, prompts, seeds)
        with reference_weights(policy) as model:
            scored = self.reference_prompts.logprobs(model, sampled.prompts, sampled.completions)
        return sampled, scored

    def _replies(
        self, model: Any, tokenizer: Any, prompts: list[list[int]], seeds: list[int]
    ) -> Sampled:
        return sample_replies(
            model,
            tokenizer,
            prompts,
            max_tokens=self.max_tokens,
            temperature=self.cfg.temperature,
            seeds=seeds,
        )

    async def probe(self, policy: Policy, version: int, weights: Any = None) -> ProbeResult:
        """Answer, judge and measure the probe set with `version`'s weights: `weights` (the
        plain model the version is served as, `Policy.export()`; LoRA adapters merged sample
        faster) or, when not given, the policy's model as it stands."""
        return (await self._measure(policy, version, weights)).result()

    async def _measure(
        self,
        policy: Policy,
        version: int,
        weights: Any = None,
        *,
        second: bool = False,
        kept: bool = False,
    ) -> Measured:
        """`version`'s judged replies to the first probe set (or the second). A `kept` version
        (version 0, or the serving one: its weights are the policy's) answers only the probes
        it has not answered before; a candidate answers them all."""
        started = time.perf_counter()
        probes = self.more if second else self.probes
        if not probes:  # nothing to answer: a result with no evidence
            return Measured(version, [], [], [], [])
        if not kept and self._candidate[0] != version:
            self._candidate = (version, {})
        known = self._kept.setdefault(version, {}) if kept else self._candidate[1]
        seeds = self._rendered(policy, second)[1]
        rows = [i for i, seed in enumerate(seeds) if seed not in known or not kept]
        if rows:
            model = weights if weights is not None else policy.model
            fresh = await self._measure_rows(policy, version, model, probes, rows, second)
            known.update((seeds[i], part) for i, part in zip(rows, pieces(fresh), strict=True))
        whole = joined([known[seed] for seed in seeds], version)
        whole.seconds = time.perf_counter() - started
        return whole

    async def _measure_rows(
        self, policy: Policy, version: int, model: Any, probes: list[Probe], rows: list[int],
        second: bool,
    ) -> Measured:  # fmt: skip
        """`model`'s judged replies to the probes at `rows` of a set."""
        prompts, seeds = self._rendered(policy, second)
        chosen, chosen_seeds = [probes[i] for i in rows], [seeds[i] for i in rows]
        sampled, reference = await asyncio.to_thread(
            self._sample, policy, version, model, [prompts[i] for i in rows], chosen_seeds
        )
        replies = await judge_replies(
            self.panel, chosen, sampled, version, self.model, chosen_seeds
        )
        sense = None
        if self.sense is not None:
            sense = await self.sense.rate([(r.question, r.reply) for r in replies])
        return Measured(version, chosen, replies, sampled.logprobs, reference, sense)

    async def assess(self, policy: Policy, version: int, weights: Any = None) -> GateVerdict:
        """Probe `version` (as `probe`) and decide whether it may be served (`decide`). Where
        the first set finds the candidate beyond a drift bound (its reward within the margins)
        and a second set was drawn (or is drawn now, `second_set_for_candidates`), it answers
        the second set too and the drift bounds apply to both sets together."""
        self.assessed += 1
        first = await self._measure(policy, version, weights)
        verdict = self.decide(first.result())
        assert self.version0 is not None and self.serving is not None
        beyond = self._drift_reasons(verdict.probe, self.version0)
        worse = self._reward_reasons(verdict.probe, self.version0, self.serving)
        if verdict.accepted or worse:
            return verdict
        version0_both = await self._second_set(policy, version)
        if version0_both is None:
            return verdict
        log.info("gate: v%d%s is beyond a bound on %d probes (%s); looking at %d more",
                 version, self._whose, len(self.probes), "; ".join(beyond), len(self.more))  # fmt: skip
        second = await self._measure(policy, version, weights, second=True)
        both = pooled(first, second).result()
        reasons = self._drift_reasons(both, version0_both)
        passed = (
            f"within the bounds on all {both.probes} probes "
            f"(the first {len(self.probes)} found: {'; '.join(beyond)})"
        )
        return GateVerdict(
            accepted=not reasons,
            reason="; ".join(reasons) or passed,
            probe=both,
            first=verdict.probe,
        )

    async def _second_set(self, policy: Policy, version: int) -> ProbeResult | None:
        """Version 0 on both sets, for a candidate beyond a drift bound on the first: the
        second set drawn with the first (the serving version was beyond), or drawn now
        (`second_set_for_candidates`); None without a second set."""
        if self.version0_both is not None:
            return self.version0_both
        if not (self.cfg.second_draw and self.cfg.second_set_for_candidates):
            return None
        self.more = await self.source.draw_more(self.probes)
        if not self.more:
            return None
        log.info("gate%s: drew %d more probes for a second look at v%d and later candidates "
                 "the first set finds beyond a drift bound", self._whose, len(self.more), version)  # fmt: skip
        version0 = await self._measure(policy, 0, second=True, kept=True)
        self.version0_both = pooled(self._on_first[0], version0).result()
        return self.version0_both

    async def start(self, policy: Policy, serving_version: int) -> None:
        """Draw the probe set; probe version 0 (the drift baseline) and the serving version."""
        await self._draw(serving_version)
        await self._baselines(policy, serving_version)

    async def refresh(self, policy: Policy, serving_version: int) -> None:
        """Before an update: a refreshing source draws a new probe set after
        `refresh_versions` candidates, and before every update while its set falls short (a
        trainer started before any traffic has none); a changed set is probed on version 0
        and the serving version (`policy` holds the serving weights now) before any
        candidate meets it."""
        if not self.source.refreshes:
            return
        due = self.assessed >= self.cfg.refresh_versions
        if not due and not self.source.fell_short(self.probes):
            return
        before = self.probes
        await self._draw(serving_version)
        if self.probes != before:
            self._live.clear()
            await self._baselines(policy, serving_version)

    async def _draw(self, version: int) -> None:
        drawn = await self.source.draw()
        self.drawn_at, self.assessed = version, 0
        if drawn == self.probes:
            return  # the same set (no new traffic): its baselines and second set stand
        self.probes, self.more, self.version0_both = drawn, [], None
        self._prompts.clear()
        self._on_first.clear()

    async def _baselines(self, policy: Policy, serving_version: int) -> None:
        """Probe version 0 and the serving version on the set; when the serving version is
        beyond a drift bound on it, look again on a set with more probes (`second_draw`)."""
        beyond = await self._probe_baselines(policy, serving_version)
        if beyond and self.cfg.second_draw:
            self.more = await self.source.draw_more(self.probes)
            if self.more:
                log.info(
                    "gate: v%d%s is beyond a bound on %d probes (%s); drew %d more, for a "
                    "second look at any version the first set finds beyond a drift bound",
                    serving_version, self._whose, len(self.probes), "; ".join(beyond),
                    len(self.more),
                )  # fmt: skip
                beyond = await self._probe_second_set(policy, serving_version)
        self._forget_other_probes()
        if beyond:
            log.warning(
                "the serving version v%d%s is itself beyond the gate's bounds on the new probe "
                "set (%s): candidates close to it will be refused until the next draw",
                serving_version, self._whose, "; ".join(beyond),
            )  # fmt: skip
        assert self.version0 is not None
        second = f" and a second set of {len(self.more)}" if self.more else ""
        log.info(
            "promotion gate%s ready: %d probes%s (%s), version 0 reward %s, reference NLL %.3f",
            self._whose,
            len(self.probes),
            second,
            self.source.name,
            _fmt(self.version0.reward),
            self.version0.ref_nll,
        )

    def _forget_other_probes(self) -> None:
        """Keep the replies of the probes in the sets drawn now only (a set grows while too
        little traffic has been served; a full one is drawn anew)."""
        drawn = {seed for _, seeds in self._prompts.values() for seed in seeds}  # as measured
        for version, known in self._kept.items():
            self._kept[version] = {seed: m for seed, m in known.items() if seed in drawn}
        self.reference_prompts.keep_only(
            p for prompts, _ in self._prompts.values() for p in prompts
        )

    async def _probe_baselines(self, policy: Policy, serving_version: int) -> list[str]:
        """Probe version 0 and the serving version on the set; the drift bounds the serving
        version itself is beyond on it (it stays served; candidates close to it are refused)."""
        self._on_first = {0: await self._measure(policy, 0, kept=True)}
        self.version0 = self._on_first[0].result()
        self.accepted(self.version0)
        if serving_version == 0:
            return []
        self._on_first[serving_version] = await self._measure(policy, serving_version, kept=True)
        serving = self._on_first[serving_version].result()
        self.accepted(serving)
        return self._drift_reasons(serving, self.version0)

    async def _probe_second_set(self, policy: Policy, serving_version: int) -> list[str]:
        """Version 0 and the serving version on the second set too; the drift bounds the
        serving version is beyond on both sets together."""
        both = {
            version: pooled(
                measured, await self._measure(policy, version, second=True, kept=True)
            ).result()
            for version, measured in self._on_first.items()
        }
        self.version0_both = both[0]
        return self._drift_reasons(both[serving_version], both[0])

    @property
    def _whose(self) -> str:
        return of_tenant(self.source.context.tenant)

    def decide(self, candidate: ProbeResult) -> GateVerdict:
        """Accept unless the candidate regresses in reward or drifts too far (reasons given)."""
        if self.version0 is None or self.serving is None:
            raise RuntimeError("PromotionGate.start() has not run")
        if not candidate.probes:
            return GateVerdict(
                accepted=True, reason="no probes yet: nothing to compare", probe=candidate
            )
        reasons = self._reward_reasons(candidate, self.version0, self.serving)
        reasons += self._drift_reasons(candidate, self.version0)
        return GateVerdict(accepted=not reasons, reason="; ".join(reasons) or None, probe=candidate)

    def _reward_reasons(
        self, candidate: ProbeResult, version0: ProbeResult, serving: ProbeResult
    ) -> list[str]:
        return reward_reasons(self.cfg, candidate, version0, serving)

    def _drift_reasons(self, candidate: ProbeResult, version0: ProbeResult) -> list[str]:
        return drift_reasons(self.cfg, self.max_kl, self.has_language, candidate, version0)

    def accepted(self, result: ProbeResult) -> None:
        """A version went live: it is the one the next candidates are compared with (and its
        replies to the probes stand when they are drawn again)."""
        self.serving = result
        self._live[result.version] = result
        while len(self._live) > KEPT_RESULTS:
            del self._live[min(self._live)]
        version, measured = self._candidate
        if version == result.version:
            self._kept[version] = measured
            self._candidate = (-1, {})
        while len(self._kept) > KEPT_RESULTS + 1:  # version 0's and the latest live ones'
            del self._kept[min(set(self._kept) - {0})]

    def serve_again(self, version: int) -> None:
        """An earlier version's weights are live again (a rollback): compare with its probes."""
        assert self.version0 is not None
        self.serving = self._live.get(version, self.version0)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f}"

"""The promotion gate: a trained version is served only if it does not make things worse.

Reward alone can rise while replies decay, so before the trainer announces a version it
answers a probe set (drawn by a probe source, `liveloop.trainer.safeguards.sources`) with the
new weights, in the trainer's own process: serving never waits for it. The version is refused when its judged
probe reward falls below the serving version's (or version 0's) by more than
`reward_margin`, when its KL to the reference model exceeds `max_kl`, when its replies'
reference NLL per token exceeds `max_nll_ratio` times version 0's, or, for a model with
language, when fewer of its replies name the question's topic than version 0's by more than
`max_topic_drop`, when more of them are no answer at all (word salad, nonsense, repeats)
than version 0's by more than `max_nonsense_rise`, or when more than `max_symbol_share` of
them are dominated by symbols. A probe reply that calls an offered tool is a call, not an
answer, and those measures leave it out (`ProbeResult.tool_call_share` counts it). A refused
version is recorded and announced as rejected (never served), and the trainer trains on from
the last accepted version. A candidate is only ever compared with versions probed on the
same set: when a refreshing source draws a new one, version 0 and the serving version are
probed on it again before the next candidate. When the serving version is itself beyond a
drift bound on the new set, the source is asked for a second set (`second_draw`): until the
next draw, a candidate that the first set finds beyond a drift bound answers the second set
too, and the drift bounds decide on both sets together (reward is compared on the first set,
where the serving version's is known). A candidate within the bounds costs one set, as
before the second draw. With no probes at all (no traffic served yet)
the gate has no evidence and accepts, saying so; a set drawn short (fewer served requests
than it wants) is drawn again before the next update, not `refresh_versions` later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
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
from liveloop.trainer.safeguards.probing import (
    Measured,
    ProbeResult,
    Sampled,
    judge_replies,
    pooled,
    render_prompts,
    reply_logprobs,
    sample_replies,
)
from liveloop.trainer.safeguards.shares import Mark, by_more_than, worse_beyond_noise

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


@contextlib.contextmanager
def reference_weights(policy: Policy) -> Iterator[Any]:
    """The reference model to generate with: the frozen copy, or the base under LoRA."""
    if policy.lora:
        with policy.model.disable_adapter():
            yield policy.model
    else:
        if policy.reference is None:
            raise RuntimeError("the promotion gate needs the reference model")
        yield policy.reference


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
        defaults = model_defaults(model)
        self.max_tokens = self.cfg.max_tokens or defaults.reply_tokens
        self.max_kl = self.cfg.max_kl if self.cfg.max_kl is not None else defaults.gate_max_kl
        self.has_language = defaults.has_language  # else the topic and symbol rules are moot
        self.version0: ProbeResult | None = None
        self.serving: ProbeResult | None = None
        self.version0_both: ProbeResult | None = None  # version 0 on both sets, once drawn
        self._on_first: dict[int, Measured] = {}  # version 0 and the serving one, to pool
        self._live: dict[int, ProbeResult] = {}  # probes of recently accepted versions
        self._prompts: dict[bool, list[list[int]]] = {}  # rendered, by "is the second set"

    def _sample(
        self, policy: Policy, version: int, weights: Any, second: bool
    ) -> tuple[Sampled, list[Any]]:
        """Replies of `weights` (the reference's for version 0) and their reference log-probs."""
        if second not in self._prompts:
            probes = self.more if second else self.probes
            self._prompts[second] = render_prompts(
                policy.tokenizer, probes, self.tool_result_reminder
            )
        prompts = self._prompts[second]
        if version == 0:
            with reference_weights(policy) as model:
                sampled = self._replies(model, policy.tokenizer, prompts)
            return sampled, sampled.logprobs
        sampled = self._replies(weights, policy.tokenizer, prompts)
        device = str(next(policy.model.parameters()).device)
        return sampled, reply_logprobs(policy.reference_logprobs, sampled, device)

    def _replies(self, model: Any, tokenizer: Any, prompts: list[list[int]]) -> Sampled:
        return sample_replies(
            model,
            tokenizer,
            prompts,
            max_tokens=self.max_tokens,
            temperature=self.cfg.temperature,
            seed=self.cfg.seed,
        )

    async def probe(self, policy: Policy, version: int, weights: Any = None) -> ProbeResult:
        """Answer, judge and measure the probe set with `version`'s weights: `weights` (the
        plain model the version is served as, `Policy.export()`; LoRA adapters merged sample
        faster) or, when not given, the policy's model as it stands."""
        return (await self._measure(policy, version, weights)).result()

    async def _measure(
        self, policy: Policy, version: int, weights: Any = None, *, second: bool = False
    ) -> Measured:
        """`version`'s judged replies to the first probe set (or the second)."""
        started = time.perf_counter()
        probes = self.more if second else self.probes
        if not probes:  # nothing to answer: a result with no evidence
            return Measured(version, [], [], [], [])
        model = weights if weights is not None else policy.model
        sampled, reference = await asyncio.to_thread(self._sample, policy, version, model, second)
        seed = self.cfg.seed + (len(self.probes) if second else 0)  # the simulated reactions'
        replies = await judge_replies(self.panel, probes, sampled, version, self.model, seed)
        sense = None
        if self.sense is not None:
            sense = await self.sense.rate([(r.question, r.reply) for r in replies])
        return Measured(version, probes, replies, sampled.logprobs, reference, sense,
                        time.perf_counter() - started)  # fmt: skip

    async def assess(self, policy: Policy, version: int, weights: Any = None) -> GateVerdict:
        """Probe `version` (as `probe`) and decide whether it may be served (`decide`). Where
        a second set was drawn and the first finds the candidate beyond a drift bound (its
        reward within the margins), it answers the second set too and the drift bounds apply
        to both sets together."""
        first = await self._measure(policy, version, weights)
        verdict = self.decide(first.result())
        assert self.version0 is not None and self.serving is not None
        beyond = self._drift_reasons(verdict.probe, self.version0)
        worse = self._reward_reasons(verdict.probe, self.version0, self.serving)
        if verdict.accepted or worse or self.version0_both is None:
            return verdict
        log.info("gate: v%d%s is beyond a bound on %d probes (%s); looking at %d more",
                 version, self._whose, len(self.probes), "; ".join(beyond), len(self.more))  # fmt: skip
        second = await self._measure(policy, version, weights, second=True)
        both = pooled(first, second).result()
        reasons = self._drift_reasons(both, self.version0_both)
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

    async def start(self, policy: Policy, serving_version: int) -> None:
        """Draw the probe set; probe version 0 (the drift baseline) and the serving version."""
        await self._draw(serving_version)
        await self._baselines(policy, serving_version)

    async def refresh(self, policy: Policy, serving_version: int) -> None:
        """Before an update: a refreshing source draws a new probe set every
        `refresh_versions` versions, and before every update while its set falls short (a
        trainer started before any traffic has none); a changed set is probed on version 0
        and the serving version (`policy` holds the serving weights now) before any
        candidate meets it."""
        if not self.source.refreshes:
            return
        due = serving_version - self.drawn_at >= self.cfg.refresh_versions
        if not due and not self.source.fell_short(self.probes):
            return
        before = self.probes
        await self._draw(serving_version)
        if self.probes != before:
            self._live.clear()
            await self._baselines(policy, serving_version)

    async def _draw(self, version: int) -> None:
        drawn = await self.source.draw()
        self.drawn_at = version
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

    async def _probe_baselines(self, policy: Policy, serving_version: int) -> list[str]:
        """Probe version 0 and the serving version on the set; the drift bounds the serving
        version itself is beyond on it (it stays served; candidates close to it are refused)."""
        self._on_first = {0: await self._measure(policy, 0)}
        self.version0 = self._on_first[0].result()
        self.accepted(self.version0)
        if serving_version == 0:
            return []
        self._on_first[serving_version] = await self._measure(policy, serving_version)
        serving = self._on_first[serving_version].result()
        self.accepted(serving)
        return self._drift_reasons(serving, self.version0)

    async def _probe_second_set(self, policy: Policy, serving_version: int) -> list[str]:
        """Version 0 and the serving version on the second set too; the drift bounds the
        serving version is beyond on both sets together."""
        both = {
            version: pooled(measured, await self._measure(policy, version, second=True)).result()
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
        """Probe reward below the serving version's (and version 0's) by more than the margin."""
        margin, new = self.cfg.reward_margin, candidate.reward
        bases = [("the serving version's", serving.reward)]
        if self.cfg.compare_with_version0 and serving.version != 0:
            bases.append(("version 0's", version0.reward))
        return [
            f"probe reward {new:+.3f} is below {name} {base:+.3f} by more than {margin:g}"
            for name, base in bases
            if base is not None and new is not None and by_more_than(base, new, margin)
        ]

    def _drift_reasons(self, candidate: ProbeResult, version0: ProbeResult) -> list[str]:
        """Drift from the reference, and replies that stopped being answers."""
        reasons: list[str] = []
        if self.max_kl is not None and candidate.kl_ref > self.max_kl:
            reasons.append(f"KL to the reference {candidate.kl_ref:.3f} > {self.max_kl:g}")
        ratio = self.cfg.max_nll_ratio
        if ratio is not None and candidate.ref_nll > ratio * version0.ref_nll:
            reasons.append(
                f"reference NLL {candidate.ref_nll:.3f} > {ratio:g} x version 0's "
                f"{version0.ref_nll:.3f}"
            )
        drop, before, now = self.cfg.max_sense_drop, version0.sense_rate, candidate.sense_rate
        if self._share_lost(version0, candidate, "sensible", drop, before, now, good=True):
            reasons.append(
                f"the sense judge read {now:.0%} of replies as sensible answers, below version "
                f"0's {before:.0%} by more than {drop:.0%}"
            )
        if not self.has_language:
            return reasons
        drop, before, now = self.cfg.max_topic_drop, version0.topic_rate, candidate.topic_rate
        if self._share_lost(version0, candidate, "on_topic", drop, before, now, good=True):
            reasons.append(
                f"topic rate {now:.0%} is below version 0's {before:.0%} by more than {drop:.0%}"
            )
        symbols = self.cfg.max_symbol_share
        if symbols is not None and candidate.symbol_share > symbols:
            reasons.append(
                f"{candidate.symbol_share:.0%} of replies dominated by symbols > {symbols:.0%}"
            )
        rise, before, now = (
            self.cfg.max_nonsense_rise,
            version0.nonsense_share,
            candidate.nonsense_share,
        )
        if self._share_lost(version0, candidate, "no_answer", rise, before, now, good=False):
            reasons.append(
                f"{now:.0%} of replies are no answer (nonsense, word salad, "
                f"repeats), above version 0's {before:.0%} by more than {rise:.0%}"
            )
        return reasons

    def _share_lost(
        self,
        version0: ProbeResult,
        candidate: ProbeResult,
        mark: Mark,
        bound: float | None,
        before: float | None,
        now: float | None,
        *,
        good: bool,
    ) -> bool:
        """Whether a share (of replies whose `mark` is `good`, or not `good` for a share of bad
        replies) got worse than version 0's by more than `bound` and beyond paired sampling
        noise (`loss_z`); never where the bound is unset or either share unmeasured."""
        if bound is None or before is None or now is None:
            return False
        high, low = (before, now) if good else (now, before)
        return by_more_than(high, low, bound) and worse_beyond_noise(
            version0, candidate, mark, good=good, z=self.cfg.loss_z
        )

    def accepted(self, result: ProbeResult) -> None:
        """A version went live: it is the one the next candidates are compared with."""
        self.serving = result
        self._live[result.version] = result
        while len(self._live) > KEPT_RESULTS:
            del self._live[min(self._live)]

    def serve_again(self, version: int) -> None:
        """An earlier version's weights are live again (a rollback): compare with its probes."""
        assert self.version0 is not None
        self.serving = self._live.get(version, self.version0)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f}"

"""A weighted panel of judges: runs each configured judge on a turn and combines the verdicts.

Every judge runs under a time limit and its output is validated; a judge that raises, times
out or returns something invalid fails the whole turn (the judging loop retries it and, in
the end, dead-letters it). Judges without an opinion (None) are left out of the weighted
mean; decisive results (explicit feedback) replace the mean of the others. The verdict's
directive hint is the longest non-trivial one among the judges counted.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from liveloop.prm.judges.base import (
    Judge,
    JudgeError,
    JudgeRequest,
    JudgeResult,
    longest_hint,
    validate_result,
)
from liveloop.prm.metrics import PrmMetrics


@dataclass
class Verdict:
    """The combined outcome for one turn, as written to the scored stream."""

    score: float
    judge: str
    step_scores: list[float] | None = None
    hint: str | None = None
    votes: list[float] | None = None
    directive_hint: str | None = None


class JudgePanel:
    """One or more judges with weights; `judge(request)` gives a Verdict or None.

    `hint_chars` bounds directive hints: (shortest that is not trivial, longest kept).
    """

    def __init__(
        self,
        judges: list[tuple[Judge, float]],
        metrics: PrmMetrics,
        timeout_s: float = 120.0,
        hint_chars: tuple[int, int] = (10, 300),
    ) -> None:
        if not judges:
            raise ValueError("a panel needs at least one judge")
        self.judges = judges
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.hint_chars = hint_chars
        self._latency = {j.name: metrics.judge_latency.labels(j.name) for j, _ in judges}
        self._scores = {j.name: metrics.judge_score.labels(j.name) for j, _ in judges}
        self._final = metrics.judge_score.labels("final")
        for judge, _ in judges:  # each judge's failure count is exported from the start, at 0
            metrics.judge_failures.labels(judge.name)

    @property
    def inline(self) -> bool:
        """True when every judge declares `inline = True` (scores without awaiting I/O)."""
        return all(judge.inline for judge, _ in self.judges)

    @property
    def names(self) -> list[str]:
        """The judges' names, in configuration order."""
        return [j.name for j, _ in self.judges]

    async def _one(self, judge: Judge, request: JudgeRequest) -> JudgeResult | None:
        start = time.perf_counter()
        try:
            if judge.inline:  # never awaits, so a timer would not help
                raw = await judge.score(request)
            else:
                async with asyncio.timeout(self.timeout_s):
                    raw = await judge.score(request)
            result = validate_result(judge.name, raw)
        except TimeoutError:
            self.metrics.judge_failures.labels(judge.name).inc()
            raise JudgeError(f"judge {judge.name!r} timed out after {self.timeout_s:g}s") from None
        except JudgeError:
            self.metrics.judge_failures.labels(judge.name).inc()
            raise
        except Exception as exc:
            self.metrics.judge_failures.labels(judge.name).inc()
            raise JudgeError(f"judge {judge.name!r} raised {type(exc).__name__}: {exc}") from exc
        self._latency[judge.name].observe(time.perf_counter() - start)
        if result is not None:
            self._scores[judge.name].observe(result.score)
            if result.directive_hint:
                self.metrics.directive_hints.labels(judge.name).inc()
            if result.votes and "disagreement" in result.extra:
                self.metrics.votes_disagreement.labels(judge.name).observe(
                    float(result.extra["disagreement"])
                )
        return result

    async def judge(self, request: JudgeRequest) -> Verdict | None:
        """Run every judge; raises JudgeError if any fails, None if none has an opinion.

        Judges of one turn run one after the other (turns themselves are judged
        concurrently), which keeps the per-turn cost of fast judges low.
        """
        results = [await self._one(judge, request) for judge, _ in self.judges]
        given = [
            (judge.name, weight, result)
            for (judge, weight), result in zip(self.judges, results, strict=True)
            if result is not None
        ]
        if not given:
            return None
        decisive = [g for g in given if g[2].decisive]
        verdict = combine(decisive or given, self.hint_chars)
        self._final.observe(verdict.score)
        if verdict.directive_hint:
            self.metrics.directive_hints.labels("final").inc()
        return verdict


def combine(
    given: list[tuple[str, float, JudgeResult]], hint_chars: tuple[int, int] = (10, 300)
) -> Verdict:
    """Weighted mean of the results; extras come from the first judge that has them.

    The directive hint is the longest non-trivial one among the results.
    """
    total = sum(w for _, w, _ in given)
    score = sum(w * r.score for _, w, r in given) / total
    hints = [f"{name}: {r.hint}" if len(given) > 1 else r.hint for name, _, r in given if r.hint]
    return Verdict(
        score=max(-1.0, min(1.0, score)),
        judge="+".join(name for name, _, _ in given),
        step_scores=next((r.step_scores for _, _, r in given if r.step_scores), None),
        hint="; ".join(h for h in hints if h) or None,
        votes=next((r.votes for _, _, r in given if r.votes), None),
        directive_hint=longest_hint([r.directive_hint for _, _, r in given], *hint_chars),
    )

"""Quality of each policy version on served traffic, beside its reward.

A rising reward is not learning: a policy can please a judge while its replies decay.
So every version is measured on the turns it served, by the loops that see them:

- the judging loop, for each turn it finishes: judged or not, the score, the reply's length
  in words, and its word bigrams (a HyperLogLog, for distinct-2);
- the trainer, for each sample it trains on: the reference model's log-prob of every
  served token, giving the reference NLL per token (how unnatural replies became) and a
  k3 estimate of KL(served policy || reference).

The counters live in one Redis hash per version (plus a HyperLogLog of its bigrams; key
names in `liveloop.bus.keys`), so any process reads the same figures; the trainer
exports them as metrics and stores them in the registry, and `liveloop eval` prints them.
A turn belongs to the oldest version that produced one of its tokens.

Version 0, the base model, serves every tenant that has no adapter of its own, so its
counters mix all tenants' traffic. A turn of version 0 is therefore also counted under its
tenant, and in tenant scope a tenant's watch compares its adapter with the base on that
tenant's own turns (`read(..., tenant=...)`): a tenant whose users score everything low
must not see its adapter rolled back because the base pleases other tenants better.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aredis
from pydantic import BaseModel, Field

from liveloop.bus import keys

WORD = re.compile(r"[A-Za-z]+(?:['’][A-Za-z]+)*")


def reply_bigrams(text: str) -> list[str]:
    """The lower-cased word bigrams of a reply (words are runs of letters)."""
    words = [w.lower() for w in WORD.findall(text or "")]
    return [f"{a} {b}" for a, b in itertools.pairwise(words)]


class VersionQuality(BaseModel):
    """The quality measures of one policy version on the turns it served."""

    version: int
    judged: int = Field(0, description="Turns the judges scored.")
    unscored: int = Field(0, description="Turns no judge could score (no next state, failures).")
    mean_reward: float | None = Field(None, description="Mean judged score.")
    reward_sd: float | None = Field(
        None, description="Standard deviation of the judged scores (two or more of them)."
    )
    unscored_share: float | None = Field(None, description="unscored / (judged + unscored).")
    mean_reply_words: float | None = Field(None, description="Mean reply length in words.")
    distinct_2: float | None = Field(None, description="Distinct reply word bigrams / bigrams.")
    ref_nll: float | None = Field(None, description="Reference model's NLL per served token.")
    kl_ref: float | None = Field(None, description="k3 KL(served policy || reference) per token.")
    ref_tokens: int = Field(0, description="Served tokens the reference measures are over.")
    ref_replies: int = Field(0, description="Served replies those tokens belong to.")

    @classmethod
    def from_counters(cls, version: int, raw: dict[str, Any], distinct: int) -> VersionQuality:
        """Derive the measures from a version's raw counters."""
        judged, unscored = int(raw.get("judged", 0)), int(raw.get("unscored", 0))
        finished = judged + unscored
        bigrams = int(raw.get("bigrams", 0))
        tokens = int(raw.get("ref_tokens", 0))
        return cls(
            version=version,
            judged=judged,
            unscored=unscored,
            mean_reward=float(raw["score_sum"]) / judged if judged else None,
            reward_sd=_sd(judged, float(raw.get("score_sum", 0)), raw.get("score_sq_sum")),
            unscored_share=unscored / finished if finished else None,
            mean_reply_words=float(raw.get("words", 0)) / finished if finished else None,
            distinct_2=min(1.0, distinct / bigrams) if bigrams else None,
            ref_nll=float(raw["ref_nll_sum"]) / tokens if tokens else None,
            kl_ref=float(raw["kl_sum"]) / tokens if tokens else None,
            ref_tokens=tokens,
            ref_replies=int(raw.get("ref_replies", 0)),
        )


def _sd(count: int, total: float, squares: Any) -> float | None:
    """Sample standard deviation from a count, a sum and a sum of squares (None: unknown)."""
    if count < 2 or squares is None:
        return None
    mean = total / count
    return math.sqrt(max(float(squares) - count * mean * mean, 0.0) / (count - 1))


@dataclass
class DriftSums:
    """Reference-model sums over served tokens of one version (from trained samples)."""

    tokens: int = 0
    nll_sum: float = 0.0
    kl_sum: float = 0.0
    replies: int = 0  # served replies (or the part of one a version sampled) the sums cover

    def add(self, other: DriftSums) -> None:
        """Fold another set of sums in."""
        self.tokens += other.tokens
        self.nll_sum += other.nll_sum
        self.kl_sum += other.kl_sum
        self.replies += other.replies


class QualityStore:
    """Per-version quality counters in Redis: written by the judge and trainer, read by all."""

    def __init__(self, client: aredis.Redis) -> None:
        self.client = client

    @staticmethod
    def queue_turn(
        pipe: Any, version: int, score: float | None, reply: str, tenant: str | None = None
    ) -> None:
        """Count one finished turn on a pipeline (`score` None: the judges could not score
        it); a turn of version 0 is counted under its `tenant` too."""
        pipe.zadd(keys.QUALITY_VERSIONS, {str(version): version})
        for counters, bigrams in _written_keys(version, tenant):
            _queue_counts(pipe, counters, bigrams, score, reply)

    async def add_drift(self, drift: dict[int, DriftSums], tenant: str | None = None) -> None:
        """Add reference-model sums per version (version 0's under `tenant` too: the
        trainer's batch in tenant scope holds that tenant's samples alone)."""
        if not drift:
            return
        async with self.client.pipeline(transaction=False) as pipe:
            for version, sums in drift.items():
                pipe.zadd(keys.QUALITY_VERSIONS, {str(version): version})
                for key, _bigrams in _written_keys(version, tenant):
                    pipe.hincrby(key, "ref_tokens", sums.tokens)
                    pipe.hincrby(key, "ref_replies", sums.replies)
                    pipe.hincrbyfloat(key, "ref_nll_sum", sums.nll_sum)
                    pipe.hincrbyfloat(key, "kl_sum", sums.kl_sum)
            await pipe.execute()

    async def versions(self) -> list[int]:
        """Every version with counters, oldest first."""
        members: Any = await self.client.zrange(keys.QUALITY_VERSIONS, 0, -1)
        return sorted(int(m) for m in members)

    async def read(
        self, versions: list[int] | None = None, tenant: str | None = None
    ) -> list[VersionQuality]:
        """The measures of the given versions (default: all), oldest first; with `tenant`,
        version 0's are those of that tenant's turns alone."""
        if versions is None:
            versions = await self.versions()
        async with self.client.pipeline(transaction=False) as pipe:
            for version in versions:
                counters, bigrams = _read_keys(version, tenant)
                pipe.hgetall(counters)
                pipe.pfcount(bigrams)
            replies = await pipe.execute()
        return [
            VersionQuality.from_counters(v, replies[2 * i] or {}, int(replies[2 * i + 1] or 0))
            for i, v in enumerate(versions)
        ]


def _read_keys(version: int, tenant: str | None) -> tuple[str, str]:
    """The (counters, bigrams) keys of `version`: for version 0 with a tenant, the tenant's."""
    if version == 0 and tenant:
        return keys.tenant_base_quality(tenant), keys.tenant_base_bigrams(tenant)
    return keys.quality_counters(version), keys.quality_bigrams(version)


def _written_keys(version: int, tenant: str | None) -> list[tuple[str, str]]:
    """Where a turn of `version` and `tenant` is counted: the version's keys, and for
    version 0 with a tenant, the tenant's too."""
    own = (keys.quality_counters(version), keys.quality_bigrams(version))
    return [own, _read_keys(version, tenant)] if version == 0 and tenant else [own]


def _queue_counts(
    pipe: Any, counters: str, bigrams_key: str, score: float | None, reply: str
) -> None:
    """One finished turn added to one hash of counters (and its bigrams' HyperLogLog)."""
    if score is None:
        pipe.hincrby(counters, "unscored", 1)
    else:
        pipe.hincrby(counters, "judged", 1)
        pipe.hincrbyfloat(counters, "score_sum", float(score))
        pipe.hincrbyfloat(counters, "score_sq_sum", float(score) ** 2)
    pipe.hincrby(counters, "words", len(WORD.findall(reply or "")))
    bigrams = reply_bigrams(reply)
    if bigrams:
        pipe.hincrby(counters, "bigrams", len(bigrams))
        pipe.pfadd(bigrams_key, *bigrams)

"""Builders shared by the collector and trainer tests (no tests here): turns, settings."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import redis.asyncio as aredis

from liveloop import bus
from liveloop.config import LiveLoopSettings, load_settings
from liveloop.contracts import ScoredTurn, WeightsAnnouncement
from liveloop.trainer.loop import Trainer

# log(1 / vocab size) of the tiny-random model: close to what its near-uniform logits give.
UNIFORM_LOGPROB = -10.8


def scored_turn(
    session: str,
    *,
    turn_index: int = 0,
    sample_index: int = 0,
    versions: list[int] | None = None,
    score: float = 0.5,
    judge: str = "rules",
    prompt_len: int = 6,
    completion_len: int | None = None,
    turn_type: str = "main",
    seed: int | None = None,
) -> ScoredTurn:
    """A judged turn with random token ids (below 1000) and uniform-ish behaviour log-probs."""
    rng = random.Random(seed if seed is not None else hash((session, turn_index, sample_index)))
    if versions is None:
        versions = [0] * (completion_len or 4)
    n = len(versions)
    return ScoredTurn(
        session_id=session,
        turn_index=turn_index,
        sample_index=sample_index,
        turn_type=turn_type,  # type: ignore[arg-type]
        tenant="t",
        request_id=f"req-{session}-{turn_index}-{sample_index}",
        messages=[{"role": "user", "content": "hi"}],
        prompt_token_ids=[rng.randrange(1, 1000) for _ in range(prompt_len)],
        completion_token_ids=[rng.randrange(1, 1000) for _ in range(n)],
        logprobs=[UNIFORM_LOGPROB] * n,
        versions=versions,
        finish_reason="stop",
        model="tiny-random",
        score=score,
        judge=judge,
    )


async def publish_turns(client: aredis.Redis, turns: list[ScoredTurn]) -> list[str]:
    """XADD judged turns to liveloop:scored; returns their entry ids."""
    ids = []
    for t in turns:
        ids.append(str(await bus.publish(client, bus.SCORED, t)))
    return ids


async def announce(client: aredis.Redis, version: int) -> None:
    """Pretend the trainer announced `version`."""
    payload = WeightsAnnouncement(version=version, path=f"/nowhere/v{version}", parent=version - 1)
    await bus.publish(client, bus.WEIGHTS, payload)


def settings_for(redis_url: str, data_dir: Path, **sections: Any) -> LiveLoopSettings:
    """Settings on the test Valkey and data dir, tiny-random model, plus section overrides."""
    return load_settings(redis_url=redis_url, data_dir=data_dir, model="tiny-random", **sections)


def trainer_of(settings: LiveLoopSettings, **kwargs: Any) -> Trainer:
    """The trainer as `liveloop train` builds it: shared settings, its section, the judges."""
    return Trainer(settings.shared(), settings.trainer, judging=settings.prm, **kwargs)

"""Paired draws (`demo.paired_draws`): runs compared side by side sample their live replies
from the same seeds, so the same policy serves both the same replies, against the real
server subprocess with the official client."""

from __future__ import annotations

import asyncio

from liveloop.config import load_settings
from liveloop.demo.preferences import WordLimit
from liveloop.demo.users import UserRun, UserStats, run_population
from tests.server_proc import API_KEYS

pytest_plugins = ["tests.server_fixtures"]

MODEL = "tiny-random"
TURNS = 4


def _replies(server_url: str, sample_seed: int | None) -> list[tuple[int, str, str]]:
    """Three users' questions and replies, four turns each, unrecorded."""
    run = UserRun(
        server_url, MODEL, API_KEYS[0], max_tokens=8, record=False, sample_seed=sample_seed
    )
    people: list[WordLimit] = [WordLimit(limit, strict=False) for limit in (4, 6, 8)]
    stats: UserStats = asyncio.run(
        run_population(run, people, seconds=120, seed=5, max_turns_per_user=TURNS)
    )
    assert len(stats.turns) == TURNS * len(people)
    return sorted((t.user, t.question, t.reply) for t in stats.turns)


def test_paired_runs_serve_the_same_replies_and_unpaired_ones_do_not(server_url: str) -> None:
    seed = load_settings(model=MODEL).demo.live_sample_seed(0)
    assert seed is not None
    paired = _replies(server_url, seed)
    assert _replies(server_url, seed) == paired
    # The same users and questions unseeded: the random model's samples differ.
    assert _replies(server_url, None) != paired


def test_each_population_has_its_own_seed_and_the_setting_turns_it_off() -> None:
    demo = load_settings(model=MODEL).demo
    again = load_settings(model=MODEL).demo
    assert demo.paired_draws
    assert [demo.live_sample_seed(t) for t in range(3)] == [
        again.live_sample_seed(t) for t in range(3)
    ]  # one run's scopes and objectives: the same seeds
    assert len({demo.live_sample_seed(t) for t in range(3)}) == 3  # tenants apart
    other_run = load_settings(model=MODEL, demo={"seed": 1}).demo
    assert other_run.live_sample_seed(0) != demo.live_sample_seed(0)
    off = load_settings(model=MODEL, demo={"paired_draws": False}).demo
    assert off.live_sample_seed(0) is None

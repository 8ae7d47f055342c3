"""Held-out users replayed against the same policy get the same replies (their sampling is
seeded), so the demo's version 0 → final comparison differs only where the policy does."""

from __future__ import annotations

from typing import Any

from liveloop.config.defaults import model_defaults
from liveloop.demo.heldout import evaluate_people
from liveloop.demo.preferences import make_population
from tests.server_proc import API_KEYS

pytest_plugins = ["tests.server_fixtures"]


def _conversations(figures: dict[str, Any]) -> list[tuple[int, str, str]]:
    return [(r["user"], r["question"], r["reply"]) for r in figures["replies"]]


def test_held_out_users_get_the_same_replies_from_the_same_policy(server_url: str) -> None:
    # One user, so every request decodes in a batch of one: rows of a larger batch can come
    # out a last bit apart with its size, which now and then samples a near-tie token the
    # other way (6 concurrent users replayed twice: 1 pair in 12 had a reply differ).
    people = make_population(1, 11, model_defaults("tiny-random").word_limits, strict=False)

    def replay(seed: int) -> dict[str, Any]:
        return evaluate_people(
            server_url, "tiny-random", people, seed, api_key=API_KEYS[0], turns_per_user=5
        )

    first, again, other = replay(5), replay(5), replay(6)
    assert first["turns"] == 5
    assert _conversations(again) == _conversations(first)
    assert again["mean_reward"] == first["mean_reward"]
    # Another seed: other users' draws and other replies (the server does sample).
    assert _conversations(other) != _conversations(first)


def test_users_ask_again_after_a_complaint_when_retries_are_set(server_url: str) -> None:
    # Strict users read tiny-random's replies as nonsense: every reply gets a complaint.
    people = make_population(1, 11, model_defaults("tiny-random").word_limits, strict=True)

    def questions(retries: int) -> tuple[list[str], list[float]]:
        figures = evaluate_people(server_url, "tiny-random", people, 5, api_key=API_KEYS[0],
                                  turns_per_user=6, retries=retries)  # fmt: skip
        assert figures["turns"] == 6
        ratings = [r["rating"] for r in figures["replies"]]
        return [r["question"] for r in figures["replies"]], ratings

    asked, ratings = questions(retries=2)
    assert all(r < 0 for r in ratings)
    # Sessions of three turns: the question, then twice the complaint and the same question.
    assert asked[0] == asked[1] == asked[2] and asked[3] == asked[4] == asked[5]
    moved_on, _ = questions(retries=0)
    assert moved_on[0] == asked[0]  # the same user draws the same first question
    assert len(set(moved_on[:3])) > 1  # each reaction came with a new question

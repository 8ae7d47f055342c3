"""Hindsight credit from a stated word limit: where a too-long reply's advantage goes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError

from liveloop.config.credit import LimitCreditSettings
from liveloop.config.trainer import TrainerConfig
from liveloop.contracts import BatchSample, SampleHint
from liveloop.models import load_tokenizer
from liveloop.trainer.credit import LimitCredit, count_words
from liveloop.trainer.data import micro_batches
from liveloop.trainer.policy import load_policy
from liveloop.trainer.ppo import PPOUpdater

REPLY = "Bees make honey in hives, and they dance to tell each other where flowers are."


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("tiny-random")


def sample(
    tokenizer: Any, hint: str | None, advantage: float = -1.0, asked: str = "Tell me about bees."
) -> BatchSample:
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    messages = [{"role": "user", "content": asked}]
    return BatchSample(
        key="k",
        prompt_token_ids=tokenizer.encode(asked, add_special_tokens=False),
        completion_token_ids=ids,
        logprobs=[-2.0] * len(ids),
        versions=[0] * len(ids),
        advantage=advantage,
        score=-1.0,
        hint=SampleHint(text=hint, messages=messages) if hint is not None else None,
    )


def test_limits_are_read_from_the_hint_then_from_the_message_answered(tokenizer: Any) -> None:
    credit = LimitCredit(LimitCreditSettings(enabled=True), tokenizer)
    assert count_words("Bees make honey 🐝🐝 !! ...") == 3
    assert credit.stated_limit(sample(tokenizer, "Shorter, please: 5 words at most.")) == 5
    asked = "That's more than I need. Keep it under 12 words, please. Tell me about bees."
    assert credit.stated_limit(sample(tokenizer, "Too long, please be brief.", asked=asked)) == 12
    assert credit.stated_limit(sample(tokenizer, "Too long, please be brief.")) is None
    earlier = [
        {"role": "user", "content": "Tell me about tea."},
        {"role": "assistant", "content": "Tea is a drink made from leaves of the tea plant."},
        {"role": "user", "content": "Shorter, please: 8 words at most. Tell me about bees."},
        {"role": "assistant", "content": "Bees make honey."},
        {"role": "user", "content": "Thanks. Tell me about owls."},
    ]
    later = sample(tokenizer, "Too long, please be brief.")
    assert later.hint is not None
    later.hint.messages = earlier
    assert credit.stated_limit(later) == 8  # said earlier in the session, it still holds
    assert credit.stated_limit(sample(tokenizer, None)) is None
    with pytest.raises(ValidationError, match="group"):
        LimitCreditSettings(patterns=[r"\d+ words"])


def test_a_reply_past_the_limit_is_blamed_from_the_first_word_past_it(tokenizer: Any) -> None:
    credit = LimitCredit(LimitCreditSettings(enabled=True, within_weight=0.25), tokenizer)
    too_long = sample(tokenizer, "Shorter, please: 5 words at most.")
    weights = credit.weights(too_long)
    assert weights is not None and len(weights) == len(too_long.completion_token_ids)
    cut = weights.index(1.0)
    assert set(weights[:cut]) == {0.25} and set(weights[cut:]) == {1.0}
    ids = too_long.completion_token_ids
    assert tokenizer.decode(ids[:cut]).strip() == "Bees make honey in hives,"
    assert tokenizer.decode(ids[cut:]).strip().startswith("and they dance")
    # Not blamed: a well-judged reply, one within the limit, one with no limit stated.
    assert credit.weights(sample(tokenizer, "5 words at most.", advantage=0.5)) is None
    assert credit.weights(sample(tokenizer, "Keep it under 40 words.")) is None
    assert credit.weights(sample(tokenizer, "That makes no sense.")) is None


def test_the_credit_shapes_the_token_advantages_and_the_update(tokenizer: Any) -> None:
    too_long = sample(tokenizer, "Shorter, please: 5 words at most.")
    credit = LimitCredit(LimitCreditSettings(enabled=True), tokenizer).for_batch([too_long])
    (mb,) = micro_batches([too_long], 4096, credit=credit)
    cut = credit["k"].index(1.0)
    expected = [0.0] * cut + [-1.0] * (len(too_long.completion_token_ids) - cut)
    assert mb.advantages.tolist() == expected

    def update(**limit_credit: object) -> tuple[list[torch.Tensor], int]:
        torch.manual_seed(0)
        policy = load_policy("tiny-random", "cpu", TrainerConfig().lora)
        cfg = TrainerConfig(lr=1e-3, kl_coef=0.0, limit_credit=limit_credit)  # type: ignore[arg-type]
        stats = PPOUpdater(policy, cfg).update([too_long])
        return [p.detach().clone() for p in policy.model.parameters()], stats.limit_credited

    plain, none = update()
    blamed, one = update(enabled=True)
    kept, also_one = update(enabled=True, within_weight=1.0)
    assert (none, one, also_one) == (0, 1, 1)
    assert any(not torch.equal(a, b) for a, b in zip(plain, blamed, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain, kept, strict=True))

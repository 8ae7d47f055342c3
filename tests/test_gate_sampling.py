"""The gate's batched sampling runs each prompt's tokens once (a shared start once for all,
no padding to the longest) and draws what a left-padded `generate` draws."""

from __future__ import annotations

import pytest
import torch

from liveloop.config import load_settings
from liveloop.trainer.policy import Policy, load_policy
from liveloop.trainer.safeguards import sampling
from liveloop.trainer.safeguards.probing import probe_seeds
from liveloop.trainer.safeguards.sampling import (
    RowSampler,
    length_groups,
    prefill,
    sample_replies,
    shared_start,
)

SYSTEM = [5, 9, 11, 30, 2, 17]  # the start every prompt of PROMPTS shares
PROMPTS = [
    [*SYSTEM, 40, 41],
    [*SYSTEM, 40, 41, 42, 43, 44, 45, 46, 47, 48],
    [*SYSTEM, 7],
    [*SYSTEM, 40, 41],  # the same prompt twice: two seeds, two replies
    [*SYSTEM, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73],
]


def _policy() -> Policy:
    settings = load_settings(model="tiny-random")
    return load_policy("tiny-random", "cpu", settings.trainer.lora)


def _padded(
    model: object, policy: Policy, prompts: list[list[int]], seeds: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    eos = sampling.end_ids(model, policy.tokenizer)
    with torch.no_grad():
        return sampling.generate_padded(
            model, policy.tokenizer, prompts, RowSampler(seeds, 1.0), 16, eos
        )


@pytest.mark.parametrize(
    "extra", [[], [[3]], [[70, 71, 72]]], ids=["shared-start", "one-token", "no-shared-start"]
)
def test_sampling_draws_what_a_left_padded_generate_draws(extra: list[list[int]]) -> None:
    policy = _policy()
    prompts = [*PROMPTS, *extra]
    seeds = probe_seeds(7, prompts)
    for model in (policy.model, policy.export()):  # the PEFT-wrapped policy and plain weights
        model.eval()
        with torch.no_grad():
            assert prefill(model, prompts) is not None  # the unpadded path, not the fallback
        sampled = sample_replies(
            model, policy.tokenizer, prompts, max_tokens=16, temperature=1.0, seeds=seeds
        )
        tokens, logprobs = _padded(model, policy, prompts, seeds)
        for i, completion in enumerate(sampled.completions):
            assert completion == tokens[i, : len(completion)].tolist()
            torch.testing.assert_close(
                sampled.logprobs[i], logprobs[i, : len(completion)], atol=1e-4, rtol=1e-4
            )
        assert sampled.completions[0] != sampled.completions[3]  # the same prompt, another seed


def test_a_model_whose_cache_cannot_be_laid_out_is_sampled_with_generate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy = _policy()
    seeds = probe_seeds(7, PROMPTS)
    fast = sample_replies(
        policy.model, policy.tokenizer, PROMPTS, max_tokens=16, temperature=1.0, seeds=seeds
    )
    monkeypatch.setattr(sampling, "_plain", lambda cache: False)
    with torch.no_grad():
        assert prefill(policy.model, PROMPTS) is None
    slow = sample_replies(
        policy.model, policy.tokenizer, PROMPTS, max_tokens=16, temperature=1.0, seeds=seeds
    )
    assert slow.completions == fast.completions
    assert slow.texts == fast.texts


def test_the_shared_start_and_length_groups() -> None:
    assert shared_start(PROMPTS) == len(SYSTEM)
    assert shared_start([[1, 2, 3], [1, 2, 3]]) == 2  # each prompt keeps its last token
    assert shared_start([[1, 2], [3, 4]]) == 0
    assert shared_start([[1]]) == 0
    assert length_groups([10, 100, 11, 0, 112, 9]) == [[3], [5, 0, 2], [1, 4]]
    assert sorted(i for g in length_groups([5, 50, 6, 300, 40]) for i in g) == [0, 1, 2, 3, 4]

"""The gate scores replies under the reference over kept prompt keys and values: the same
log-probs a full forward of prompt and reply gives, for every candidate the set meets, with
the prompt run once, within a memory budget."""

from __future__ import annotations

import pytest
import torch

from bench.gate import set_adapters
from liveloop.config.trainer import LoraSettings
from liveloop.trainer.policy import Policy, completion_logprobs, load_policy
from liveloop.trainer.safeguards.prefixes import ReferencePrompts, reference_weights
from liveloop.trainer.safeguards.probing import Sampled, reply_logprobs
from liveloop.trainer.safeguards.sampling import sample_replies

PROMPTS = [[5, 9, 11, 30, 2, 17, 18, 19], [7, 8], [40, 41, 42, 43, 44], [3]]


def _lora_policy() -> Policy:
    return load_policy("tiny-random", "cpu", LoraSettings(enabled=True, rank=4, alpha=8))


def _candidate(policy: Policy, seed: int) -> None:
    """Move the adapters off zero, as an update does: the policy is no longer the reference."""
    set_adapters(policy, seed, scale=0.5)


def _replies(policy: Policy, seed: int) -> Sampled:
    seeds = [seed + i for i in range(len(PROMPTS))]
    return sample_replies(
        policy.model, policy.tokenizer, PROMPTS, max_tokens=10, temperature=1.0, seeds=seeds
    )


def _full_pass(policy: Policy, sampled: Sampled) -> list[torch.Tensor]:
    """The reference log-probs of one packed forward of every prompt and reply."""
    return reply_logprobs(policy.reference_logprobs, sampled, "cpu")


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert [len(x) for x in got] == [len(x) for x in want]
    for mine, full in zip(got, want, strict=True):
        torch.testing.assert_close(mine, full, atol=1e-4, rtol=1e-4)


def test_candidates_get_the_full_pass_log_probs_with_each_prompt_run_once() -> None:
    policy = _lora_policy()
    kept = ReferencePrompts(budget_mib=64)
    for candidate in range(3):
        _candidate(policy, candidate)
        sampled = _replies(policy, seed=10 * candidate)
        with reference_weights(policy) as model:
            got = kept.logprobs(model, sampled.prompts, sampled.completions)
        _assert_equal(got, _full_pass(policy, sampled))
        # the policy's own log-probs differ: the reference really is the base
        assert any(
            not torch.allclose(g, own, atol=1e-3)
            for g, own in zip(got, sampled.logprobs, strict=True)
        )
    assert kept.encoded == len(PROMPTS)  # each prompt once, for all three candidates
    assert kept.reused == 2 * len(PROMPTS)
    assert set(kept.entries) == {tuple(p) for p in PROMPTS}
    for prompt, entry in kept.entries.items():
        assert entry.cache.get_seq_length() == len(prompt)  # each reply's tokens cut back off
    assert 0 < kept.used <= 64 * 2**20


def test_a_prompt_beyond_the_budget_is_run_with_its_reply_each_time() -> None:
    policy = _lora_policy()
    _candidate(policy, 1)
    sampled = _replies(policy, seed=3)
    none = ReferencePrompts(budget_mib=0)
    for _ in range(2):
        with reference_weights(policy) as model:
            got = none.logprobs(model, sampled.prompts, sampled.completions)
        _assert_equal(got, _full_pass(policy, sampled))
    assert none.entries == {} and none.reused == 0 and none.encoded == 2 * len(PROMPTS)


def test_a_plain_reference_model_and_dropping_prompts_no_longer_drawn() -> None:
    policy = load_policy("tiny-random", "cpu", LoraSettings(), with_reference=True)
    with torch.no_grad():  # full-weight training: the policy drifts from its frozen copy
        for weight in policy.model.parameters():
            weight.add_(torch.randn_like(weight) * 0.2)
    sampled = _replies(policy, seed=5)
    kept = ReferencePrompts(budget_mib=64)
    assert policy.reference is not None
    got = kept.logprobs(policy.reference, sampled.prompts, sampled.completions)
    reference = policy.reference
    want = reply_logprobs(lambda mb: completion_logprobs(reference, mb)[0], sampled, "cpu")
    _assert_equal(got, want)
    kept.keep_only(PROMPTS[:2])
    assert set(kept.entries) == {tuple(p) for p in PROMPTS[:2]}
    again = kept.logprobs(policy.reference, sampled.prompts, sampled.completions)
    _assert_equal(again, want)
    assert kept.encoded == len(PROMPTS) + 2  # the two dropped prompts are run again


def test_a_cache_that_cannot_be_cut_back_is_dropped_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model whose cache cannot crop (e.g. sliding-window layers) keeps no entries: each
    reply is scored after its prompt again, never over a cache a reply has grown."""
    policy = _lora_policy()
    _candidate(policy, 2)
    sampled = _replies(policy, seed=7)
    kept = ReferencePrompts(budget_mib=64)

    def cannot_crop(self: object, max_length: int) -> None:
        raise NotImplementedError("no crop here")

    with reference_weights(policy) as model:
        first = kept.logprobs(model, sampled.prompts[:1], sampled.completions[:1])
        [entry] = kept.entries.values()
        monkeypatch.setattr(type(entry.cache), "crop", cannot_crop)
        got = kept.logprobs(model, sampled.prompts, sampled.completions)
    want = _full_pass(policy, sampled)
    _assert_equal(first, want[:1])
    _assert_equal(got, want)
    long_replies = sum(len(c) > 1 for c in sampled.completions)
    assert long_replies and len(kept.entries) == len(PROMPTS) - long_replies

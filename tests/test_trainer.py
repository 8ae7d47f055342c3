"""One update on the real tiny-random model: packed log-probs, proximal pass, normalisation."""

from __future__ import annotations

import random

import pytest
import torch

from liveloop.config import load_settings
from liveloop.config.trainer import TrainerConfig
from liveloop.contracts import BatchSample
from liveloop.trainer.data import (
    balanced_split,
    build_micro_batch,
    micro_batches,
    pack_rows,
    share_prefixes,
)
from liveloop.trainer.policy import Policy, completion_logprobs, load_policy
from liveloop.trainer.ppo import PPOUpdater


def make_samples(n: int, seed: int = 0) -> list[BatchSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, c = rng.randint(3, 30), rng.randint(1, 20)
        out.append(
            BatchSample(
                key=f"s{seed}-{i}",
                prompt_token_ids=[rng.randrange(1, 1000) for _ in range(p)],
                completion_token_ids=[rng.randrange(1, 1000) for _ in range(c)],
                logprobs=[-10.8 + rng.uniform(-0.5, 0.5) for _ in range(c)],
                versions=[0] * c,
                advantage=rng.uniform(-1, 1),
                score=0.0,
            )
        )
    return out


def session_samples(seed: int = 6) -> list[BatchSample]:
    """Three turns of one session, each prompt extending the turn before token-exactly; a
    reply to turn 0's prompt that differs from the one the session kept; another session."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 1000) for _ in range(n)]

    def sample(key: str, prompt: list[int], completion: list[int], version: int) -> BatchSample:
        n = len(completion)
        logprobs = [-10.8 + rng.uniform(-0.5, 0.5) for _ in range(n)]
        return BatchSample(
            key=key, prompt_token_ids=prompt, completion_token_ids=completion,
            logprobs=logprobs, versions=[version] * n, advantage=rng.uniform(-1, 1), score=0.0,
        )  # fmt: skip

    turn0 = sample("a:0", tokens(9), tokens(7), 0)
    turn1 = sample(
        "a:1", turn0.prompt_token_ids + turn0.completion_token_ids + tokens(5), tokens(8), 1
    )
    turn2 = sample(
        "a:2", turn1.prompt_token_ids + turn1.completion_token_ids + tokens(4), tokens(6), 1
    )
    other_reply = sample("b:0", list(turn0.prompt_token_ids), tokens(7), 0)
    other_session = sample("c:0", tokens(12), tokens(5), 0)
    return [turn1, other_session, turn0, other_reply, turn2]


def policy() -> Policy:
    return load_policy("tiny-random", "cpu", load_settings().trainer.lora)


def trainer_cfg(**kw: object) -> TrainerConfig:
    return TrainerConfig(**{"lr": 1e-3, **kw})  # type: ignore[arg-type]


def params(p: Policy) -> list[torch.Tensor]:
    return [t.detach().clone() for t in p.model.parameters()]


def test_packed_logprobs_match_a_plain_forward() -> None:
    pol = policy()
    samples = make_samples(4)
    with torch.no_grad():
        packed = completion_logprobs(pol.model, build_micro_batch(samples))[0]
        plain = []
        for s in samples:
            ids = torch.tensor([s.prompt_token_ids + s.completion_token_ids])
            logp = pol.model(ids).logits[0].log_softmax(-1)
            start = len(s.prompt_token_ids) - 1
            rows = logp[start : start + len(s.completion_token_ids)]
            plain.append(rows.gather(1, torch.tensor(s.completion_token_ids)[:, None])[:, 0])
    torch.testing.assert_close(packed, torch.cat(plain), atol=1e-5, rtol=0)


def test_fused_proximal_gives_the_same_update_as_a_separate_no_grad_pass() -> None:
    samples = make_samples(6)
    a, b = policy(), policy()
    stats_a = PPOUpdater(a, trainer_cfg(fuse_proximal=True)).update(samples)
    stats_b = PPOUpdater(b, trainer_cfg(fuse_proximal=False)).update(samples)
    for x, y in zip(params(a), params(b), strict=True):
        assert torch.equal(x, y)
    assert stats_a.loss == stats_b.loss and stats_a.iw_mean == stats_b.iw_mean
    assert params(a)[0].ne(params(policy())[0]).any()  # the update did change the weights


def test_micro_batching_does_not_change_the_update() -> None:
    samples = make_samples(8, seed=1)
    a, b = policy(), policy()
    PPOUpdater(a, trainer_cfg(micro_batch_tokens=4096)).update(samples)
    stats = PPOUpdater(b, trainer_cfg(micro_batch_tokens=40)).update(samples)
    assert len(micro_batches(samples, 40)) > 4
    # The step's gradients (left in .grad) agree to float precision. Adam divides by the
    # gradient's scale, so a near-zero gradient's noise may move a weight by a fraction of
    # lr: the weights are compared within lr / 20 (lr = 1e-3 here).
    for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert x.grad is not None and y.grad is not None
        torch.testing.assert_close(x.grad, y.grad, atol=1e-6, rtol=1e-3)
        torch.testing.assert_close(x, y, atol=5e-5, rtol=0)
    assert stats.samples == 8 and stats.optimizer_steps == 1
    assert stats.forward_tokens == sum(s.num_tokens for s in samples)


def test_later_minibatches_are_anchored_to_the_proximal_policy() -> None:
    samples = make_samples(8, seed=2)
    stats = PPOUpdater(policy(), trainer_cfg(minibatches=2, lr=5e-2)).update(samples)
    assert stats.optimizer_steps == 2
    # The second step's ratio moved away from 1, so some tokens were clipped and KL > 0.
    assert stats.approx_kl > 0
    assert 0 < stats.clip_fraction < 1


def test_an_adapter_of_one_tenant_takes_tenant_minibatches_steps_per_batch() -> None:
    samples = make_samples(8, seed=2)
    lora = {"enabled": True}
    tenant = trainer_cfg(scope="tenant", lora=lora, minibatches=1, tenant_minibatches=3)
    assert PPOUpdater(policy(), tenant).update(samples).optimizer_steps == 3
    shared = trainer_cfg(scope="shared", lora=lora, minibatches=1, tenant_minibatches=3)
    assert PPOUpdater(policy(), shared).update(samples).optimizer_steps == 1
    unset = trainer_cfg(scope="tenant", lora=lora, minibatches=2)
    assert PPOUpdater(policy(), unset).update(samples).optimizer_steps == 2


def test_kl_to_the_frozen_reference_is_reported_and_grows() -> None:
    samples = make_samples(4, seed=3)
    pol = load_policy("tiny-random", "cpu", load_settings().trainer.lora, with_reference=True)
    updater = PPOUpdater(pol, trainer_cfg(kl_coef=0.1, lr=1e-2))
    first = updater.update(samples)
    second = updater.update(samples)
    assert first.ref_kl == pytest.approx(0.0, abs=1e-9)  # still the reference's weights
    assert second.ref_kl > 0


def test_balanced_split_ignores_arrival_order() -> None:
    samples = make_samples(9, seed=4)
    parts = balanced_split(samples, 2)
    again = balanced_split(list(reversed(samples)), 2)
    assert [[s.key for s in p] for p in parts] == [[s.key for s in p] for p in again]
    loads = [sum(s.num_tokens for s in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= max(s.num_tokens for s in samples)


def test_importance_cap_masks_tokens_from_a_distant_behaviour_policy() -> None:
    samples = make_samples(3, seed=5)
    for s in samples[:1]:
        s.logprobs = [-30.0] * len(s.logprobs)  # w = e^(~19): far over the cap
    stats = PPOUpdater(policy(), trainer_cfg()).update(samples)
    masked_tokens = len(samples[0].completion_token_ids)
    total = sum(len(s.completion_token_ids) for s in samples)
    assert stats.masked_fraction == pytest.approx(masked_tokens / total)
    assert stats.iw_max > 5.0


def test_a_session_s_earlier_turns_ride_in_the_row_of_its_last_turn() -> None:
    samples = session_samples()
    rows = share_prefixes(samples)
    groups = sorted([s.key for s in row.samples] for row in rows)
    assert groups == [["a:0", "a:1", "a:2"], ["b:0"], ["c:0"]]
    (mb,) = micro_batches(samples, 4096)
    assert mb.num_tokens == sum(row.num_tokens for row in rows) < sum(s.num_tokens for s in samples)
    assert mb.num_samples == len(samples)
    pol = policy()
    with torch.no_grad():
        shared = completion_logprobs(pol.model, pack_rows(rows))[0]
        alone = [
            completion_logprobs(pol.model, build_micro_batch([s]))[0]
            for r in rows
            for s in r.samples
        ]
    torch.testing.assert_close(shared, torch.cat(alone), atol=1e-5, rtol=0)
    assert mb.segments == [
        (len(s.completion_token_ids), s.min_version) for r in rows for s in r.samples
    ]


def test_sharing_prefixes_does_not_change_the_update() -> None:
    samples = session_samples(seed=7)
    lora = load_settings().trainer.lora
    a, b = (load_policy("tiny-random", "cpu", lora, with_reference=True) for _ in range(2))
    shared = PPOUpdater(a, trainer_cfg(kl_coef=0.1)).update(samples)
    alone = PPOUpdater(b, trainer_cfg(kl_coef=0.1, share_prefixes=False)).update(samples)
    assert shared.row_tokens < alone.row_tokens == alone.forward_tokens == shared.forward_tokens
    assert shared.loss == pytest.approx(alone.loss, abs=1e-6)
    assert shared.entropy == pytest.approx(alone.entropy, rel=1e-5)
    assert shared.drift.keys() == alone.drift.keys() == {0, 1}
    for version, sums in shared.drift.items():
        assert sums.tokens == alone.drift[version].tokens
        assert sums.nll_sum == pytest.approx(alone.drift[version].nll_sum, rel=1e-5)
        assert sums.kl_sum == pytest.approx(alone.drift[version].kl_sum, rel=1e-4, abs=1e-7)
    for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert x.grad is not None and y.grad is not None
        torch.testing.assert_close(x.grad, y.grad, atol=1e-6, rtol=1e-3)
        torch.testing.assert_close(x, y, atol=5e-5, rtol=0)

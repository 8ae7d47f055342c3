"""The decoupled PPO objective against hand-computed values, its cap, and standard PPO."""

from __future__ import annotations

import math

import pytest
import torch

from liveloop.config.trainer import TrainerConfig
from liveloop.trainer.loss import (
    KL_LINEAR_FROM,
    LossConfig,
    bounded_k3,
    decoupled_ppo_loss,
    k3_kl,
)

CFG = LossConfig(eps_low=0.2, eps_high=0.28, iw_cap=5.0, iw_cap_mode="mask", kl_coef=0.0)
LN = math.log


def tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Five tokens, each exercising one branch (ratio r = e^(c-p), weight w = e^(p-b))."""
    # token:            0      1          2          3          4
    proximal = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    # r:                1      1.5        0.5        0.5        1
    current = proximal + torch.tensor([0.0, LN(1.5), LN(0.5), LN(0.5), 0.0], dtype=torch.float64)
    # w:                1      2          1          e^0.5      10 (over the cap of 5)
    behaviour = proximal - torch.tensor([0.0, LN(2.0), 0.0, 0.5, LN(10.0)], dtype=torch.float64)
    advantages = torch.tensor([2.0, 1.0, -1.0, 1.0, 1.0], dtype=torch.float64)
    return current.requires_grad_(True), proximal, behaviour, advantages


def test_loss_and_gradient_match_hand_computation_mask_mode() -> None:
    current, proximal, behaviour, advantages = tokens()
    terms = decoupled_ppo_loss(current, proximal, behaviour, advantages, CFG)
    w3 = math.exp(0.5)
    # token 0: -1*min(1*2, 1*2) = -2            d/dc = -w*A*r = -2
    # token 1: -2*min(1.5, 1.28) = -2.56        clipped branch: d/dc = 0
    # token 2: -1*min(-0.5, -0.8) = 0.8         clipped branch: d/dc = 0
    # token 3: -w3*min(0.5, 0.8) = -0.5*w3      d/dc = -w3*1*0.5
    # token 4: w = 10 > 5, masked: 0            d/dc = 0
    expected = [-2.0, -2.56, 0.8, -0.5 * w3, 0.0]
    mean = terms.loss_sum / terms.tokens
    assert mean.item() == pytest.approx(sum(expected) / 5, abs=1e-12)
    mean.backward()
    assert current.grad is not None
    expected_grad = torch.tensor([-2.0, 0.0, 0.0, -0.5 * w3, 0.0], dtype=torch.float64) / 5
    torch.testing.assert_close(current.grad, expected_grad, rtol=0, atol=1e-12)
    assert terms.tokens == 5
    assert terms.clipped == 2  # tokens 1 and 2
    assert terms.masked == 1  # token 4
    assert terms.iw_max == pytest.approx(10.0)
    assert terms.iw_sum == pytest.approx(1 + 2 + 1 + w3 + 10)


def test_clamp_mode_caps_the_weight_instead_of_masking() -> None:
    current, proximal, behaviour, advantages = tokens()
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, iw_cap=5.0, iw_cap_mode="clamp", kl_coef=0.0)
    terms = decoupled_ppo_loss(current, proximal, behaviour, advantages, cfg)
    w3 = math.exp(0.5)
    # token 4 now counts with w = 5: -5*min(1, 1) = -5, d/dc = -5
    assert terms.loss_sum.item() == pytest.approx(-2.0 - 2.56 + 0.8 - 0.5 * w3 - 5.0, abs=1e-12)
    terms.loss_sum.backward()
    assert current.grad is not None
    assert current.grad[4].item() == pytest.approx(-5.0)
    assert terms.masked == 1  # still reported as over the cap


def test_with_behaviour_equal_proximal_it_is_exactly_standard_ppo() -> None:
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(64, generator=gen) * 5
    new = (old + torch.randn(64, generator=gen) * 0.3).requires_grad_(True)
    adv = torch.randn(64, generator=gen)
    terms = decoupled_ppo_loss(new, old, old.clone(), adv, CFG)

    ref_new = new.detach().clone().requires_grad_(True)
    ratio = torch.exp(ref_new - old)
    textbook = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.28) * adv).sum()
    assert torch.equal(terms.loss_sum.detach(), textbook.detach())
    terms.loss_sum.backward()
    textbook.backward()
    assert new.grad is not None and ref_new.grad is not None
    assert torch.equal(new.grad, ref_new.grad)
    assert terms.masked == 0 and terms.iw_max == 1.0


def test_kl_penalty_to_reference_adds_k3_per_token() -> None:
    current = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    reference = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    zeros = torch.zeros(2, dtype=torch.float64)
    cfg = LossConfig.of(TrainerConfig(), kl_coef=0.5)
    terms = decoupled_ppo_loss(current, current.detach(), current.detach(), zeros, cfg, reference)
    d = reference - current.detach()
    k3 = torch.exp(d) - d - 1
    assert terms.loss_sum.item() == pytest.approx(0.5 * k3.sum().item())
    assert terms.ref_kl_sum == pytest.approx(k3.sum().item())
    terms.loss_sum.backward()
    assert current.grad is not None
    # d/dc [exp(r - c) - (r - c) - 1] = 1 - exp(r - c)
    torch.testing.assert_close(current.grad, 0.5 * (1 - torch.exp(d)))


def test_k3_is_zero_for_equal_policies_and_positive_otherwise() -> None:
    a = torch.tensor([-1.0, -2.0])
    assert torch.equal(k3_kl(a, a), torch.zeros(2))
    assert bool((k3_kl(a, a + 0.1) > 0).all())


def test_the_reference_penalty_grows_linearly_past_its_bound() -> None:
    current = torch.tensor([-1.0, -1.0, -20.0, -60.0], dtype=torch.float64, requires_grad=True)
    reference = torch.tensor([-2.0, -0.5, -1.0, -1.0], dtype=torch.float64)  # d: -1, .5, 19, 59
    penalty = bounded_k3(current, reference)
    exact = k3_kl(current.detach(), reference)
    torch.testing.assert_close(penalty[:2].detach(), exact[:2])  # k3 itself near the reference
    c = KL_LINEAR_FROM
    at_bound = math.exp(c) - c - 1
    expected = [at_bound + math.expm1(c) * (d - c) for d in (19.0, 59.0)]
    torch.testing.assert_close(penalty[2:].detach(), torch.tensor(expected, dtype=torch.float64))
    assert float(exact[3]) > 1e25  # what k3 itself gives there
    penalty.sum().backward()
    assert current.grad is not None and bool(torch.isfinite(current.grad).all())
    # d/dc of k3 is 1 - exp(r - c); past the bound the pull is a constant -(e^c - 1)
    torch.testing.assert_close(
        current.grad[:2], 1 - torch.exp(reference[:2] - current[:2].detach())
    )
    torch.testing.assert_close(
        current.grad[2:], torch.full((2,), -math.expm1(c), dtype=torch.float64)
    )


def test_a_far_token_no_longer_swamps_the_loss() -> None:
    current = torch.tensor([-1.0, -20.0], dtype=torch.float64, requires_grad=True)
    reference = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    advantages = torch.tensor([1.0, 1.0], dtype=torch.float64)
    cfg = LossConfig.of(TrainerConfig(), kl_coef=0.1)
    terms = decoupled_ppo_loss(
        current, current.detach(), current.detach(), advantages, cfg, reference
    )
    assert terms.ref_kl_sum < 200  # k3 alone: exp(19) - 20, about 1.8e8
    assert terms.loss_sum.item() == pytest.approx(-2.0 + 0.1 * terms.ref_kl_sum)

"""The decoupled PPO objective as pure tensor arithmetic.

Asynchronous PPO trains on tokens sampled by older policies. The decoupled objective
separates the two roles the "old" policy plays in PPO: the *behaviour* policy that sampled
a token (log-prob `b`, recorded by the server) and the *proximal* policy the update is
trust-region-anchored to (log-prob `p`, the trainer's weights before the update):

    ratio  = exp(c - p)
    w      = exp(p - b)                      # detached importance weight
    loss_t = -w * min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)

Tokens with `w` above `iw_cap` are masked (weight 0, but still counted in the token mean,
so the normaliser does not depend on the weights) or clamped to the cap. This module
returns token *sums*, not means, so micro-batches and data-parallel ranks can add their
parts and divide once by the global token count. It knows nothing about models or I/O,
which keeps the arithmetic and its gradient checkable by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from liveloop.config.trainer import TrainerConfig

# exp() of a log importance weight above this is reported as exp(_MAX_LOG_W): avoids inf.
_MAX_LOG_W = 30.0
# The reference penalty's k3 grows linearly, not exponentially, once the reference finds a
# token more than e^2 (7.4x) likelier than the current policy does (`bounded_k3`).
KL_LINEAR_FROM = 2.0


@dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters of the loss: the subset of `TrainerConfig` it reads (defaults there)."""

    eps_low: float
    eps_high: float
    iw_cap: float
    iw_cap_mode: Literal["mask", "clamp"]
    kl_coef: float  # 0: no KL penalty to the reference

    @classmethod
    def of(cls, cfg: TrainerConfig, **overrides: float | str) -> LossConfig:
        """From the trainer settings (an unset `kl_coef` is 0), with `overrides` applied."""
        values = {
            "eps_low": cfg.eps_low,
            "eps_high": cfg.eps_high,
            "iw_cap": cfg.iw_cap,
            "iw_cap_mode": cfg.iw_cap_mode,
            "kl_coef": cfg.kl_coef or 0.0,
        }
        return cls(**{**values, **overrides})  # type: ignore[arg-type]


@dataclass
class LossTerms:
    """Token sums of one micro-batch; add them up, then divide by the token count."""

    loss_sum: torch.Tensor  # carries the gradient
    tokens: float
    clipped: float  # tokens where the clipped branch is the smaller one
    masked: float  # tokens whose importance weight exceeded the cap
    iw_sum: float
    iw_max: float
    approx_kl_sum: float  # k3 estimate of KL(proximal || current)
    ref_kl_sum: float  # bounded_k3 sum against the reference, 0 without one


def k3_kl(logp_sampling: torch.Tensor, logp_other: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(sampling || other): exp(d) - d - 1 with d = other - sampling.

    Non-negative and unbiased for tokens drawn from the sampling distribution.
    """
    d = logp_other - logp_sampling
    return torch.exp(d) - d - 1.0


def bounded_k3(logp_sampling: torch.Tensor, logp_other: torch.Tensor) -> torch.Tensor:
    """k3 (`k3_kl`) while d = other - sampling <= KL_LINEAR_FROM, its tangent line beyond.

    The KL anchor's tokens were sampled by the served version, not the current policy, so
    k3's exp(d) is unbounded on them: a single token the current policy has pushed far
    below the reference would outweigh the whole batch, and with the gradient clipped the
    update would go to that token alone. Past the bound the penalty still pulls, with a
    constant slope of e^2 - 1 a token.
    """
    d = logp_other - logp_sampling
    near = d.clamp(max=KL_LINEAR_FROM)  # no exp() of a large d, nor of its gradient
    slope = torch.expm1(torch.tensor(KL_LINEAR_FROM, dtype=d.dtype))
    return torch.exp(near) - near - 1.0 + slope * (d - near)


def importance_weights(
    proximal: torch.Tensor, behaviour: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(raw w, the weight applied to each token, tokens over the cap), all detached."""
    log_w = (proximal - behaviour).detach().clamp(max=_MAX_LOG_W)
    raw = torch.exp(log_w)
    over = raw > cfg.iw_cap
    if cfg.iw_cap_mode == "mask":
        applied = torch.where(over, torch.zeros_like(raw), raw)
    else:
        applied = raw.clamp(max=cfg.iw_cap)
    return raw, applied, over


def decoupled_ppo_loss(
    current: torch.Tensor,
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    cfg: LossConfig,
    reference: torch.Tensor | None = None,
) -> LossTerms:
    """Sum of the per-token decoupled PPO loss over a 1-D run of completion tokens.

    `current` carries the gradient; `proximal`, `behaviour`, `advantages` and `reference`
    are treated as constants. The KL penalty to the reference (`bounded_k3`, when `kl_coef`
    > 0 and a reference is given) applies to every token, capped or not.
    """
    proximal = proximal.detach()
    advantages = advantages.detach()
    raw_w, w, over = importance_weights(proximal, behaviour, cfg)
    ratio = torch.exp(current - proximal)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * advantages
    per_token = -w * torch.minimum(unclipped, clipped)
    ref_kl_sum = 0.0
    if reference is not None:
        ref_kl = bounded_k3(current, reference.detach())
        ref_kl_sum = float(ref_kl.detach().sum())
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * ref_kl
    loss_sum = per_token.sum()
    with torch.no_grad():
        approx_kl = k3_kl(proximal, current.detach())
        n = current.numel()
        return LossTerms(
            loss_sum=loss_sum,
            tokens=float(n),
            clipped=float((clipped < unclipped).sum()),
            masked=float(over.sum()),
            iw_sum=float(raw_w.sum()),
            iw_max=float(raw_w.max()) if n else 0.0,
            approx_kl_sum=float(approx_kl.sum()),
            ref_kl_sum=ref_kl_sum,
        )

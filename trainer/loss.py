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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from liveloop.config.base import Objective

# exp() of a log importance weight above this is reported as exp(_MAX_LOG_W): avoids inf.
_MAX_LOG_W = 30.0


@dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters of the objective (a subset of `TrainerConfig`)."""

    eps_low: float = 0.2
    eps_high: float = 0.28
    iw_cap: float = 5.0
    iw_cap_mode: Literal["mask", "clamp"] = "mask"
    kl_coef: float = 0.0


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
    ref_kl_sum: float  # k3 estimate of KL(current || reference), 0 without a reference


def k3_kl(logp_sampling: torch.Tensor, logp_other: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(sampling || other): exp(d) - d - 1 with d = other - sampling.

    Non-negative and unbiased for tokens drawn from the sampling distribution.
    """
    d = logp_other - logp_sampling
    return torch.exp(d) - d - 1.0


@dataclass(frozen=True)
class AdvantageConfig:
    """How token advantages are made: the objective, its weights and the OPD clamp."""

    objective: Objective = "rl"
    rl_weight: float = 1.0
    opd_weight: float = 1.0
    opd_clip: float | None = 5.0
    opd_center: bool = False


def opd_advantages(
    teacher: torch.Tensor,
    proximal: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
    lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """log pi_teacher - log pi_proximal per token (clamped to +-clip), 0 where `mask` is 0.

    With `lengths` (completion tokens of each reply, in row order), each reply's taught
    tokens are centred on their own mean: a baseline per reply, which leaves the expected
    gradient as it is but drops the push on every sampled token at once that a teacher
    surprised by the whole reply gives (it raises the student's entropy).
    """
    gap = (teacher - proximal).detach()
    if clip is not None:
        gap = gap.clamp(-clip, clip)
    gap = gap * mask
    if lengths is None:
        return gap
    parts = []
    for g, m in zip(gap.split(list(lengths)), mask.split(list(lengths)), strict=True):
        taught = m.sum()
        parts.append(g - m * (g.sum() / taught) if taught > 0 else g)
    return torch.cat(parts) if parts else gap


def opd_term(
    teacher: torch.Tensor,
    proximal: torch.Tensor,
    mask: torch.Tensor,
    cfg: AdvantageConfig,
    lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """`opd_weight` x the OPD advantage, centred per reply when `cfg.opd_center`.

    `lengths`: completion tokens of each reply in row order, needed when `cfg.opd_center`.
    """
    if cfg.opd_center and lengths is None:
        raise ValueError("centred OPD advantages need each reply's length")
    per_reply = lengths if cfg.opd_center else None
    return cfg.opd_weight * opd_advantages(teacher, proximal, mask, cfg.opd_clip, per_reply)


def token_advantages(
    scalar: torch.Tensor, opd: torch.Tensor | None, cfg: AdvantageConfig
) -> torch.Tensor:
    """Each token's advantage under the objective, from the scalar advantage and `opd_term`."""
    if cfg.objective == "rl":
        return scalar.detach()
    if opd is None:
        raise ValueError(f"the {cfg.objective!r} objective needs the OPD term")
    if cfg.objective == "opd":
        return opd
    return cfg.rl_weight * scalar.detach() + opd


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
    are treated as constants. The KL penalty to the reference (when `kl_coef` > 0 and a
    reference is given) applies to every token, capped or not.
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
        ref_kl = k3_kl(current, reference.detach())
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

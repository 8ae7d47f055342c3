"""One policy update on one batch: proximal log-probs, decoupled PPO steps, statistics.

A batch is split into `minibatches` (one optimizer step each); each minibatch is split
across data-parallel ranks and packed into micro-batches. Proximal log-probs are computed
under the weights before the first step, without gradients. Each micro-batch's loss is its
token sum divided by the *global* completion-token count of its minibatch, and gradients
are summed over ranks, so the step equals the token-level mean over the whole minibatch no
matter how it was divided.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from liveloop.config.trainer import TrainerConfig
from liveloop.contracts import BatchSample
from liveloop.quality import DriftSums
from liveloop.trainer.data import MicroBatch, balanced_split, micro_batches
from liveloop.trainer.dist import Comm
from liveloop.trainer.loss import LossConfig, LossTerms, decoupled_ppo_loss
from liveloop.trainer.policy import Policy, completion_logprobs

if TYPE_CHECKING:
    import torch

# Order of the summed statistics in the all-reduced tensor.
_SUMS = ("loss", "tokens", "clipped", "masked", "iw", "approx_kl", "ref_kl", "entropy")


@dataclass
class UpdateStats:
    """What one update did, as token-level means over the whole batch."""

    loss: float
    clip_fraction: float
    iw_mean: float
    iw_max: float
    masked_fraction: float
    approx_kl: float
    ref_kl: float
    entropy: float
    grad_norm: float
    samples: int
    completion_tokens: int
    forward_tokens: int
    optimizer_steps: int
    seconds: float
    drift: dict[int, DriftSums] = field(default_factory=dict)  # per served version

    @property
    def tokens_per_s(self) -> float:
        """Forward tokens (prompt + completion) trained per second."""
        return self.forward_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_metrics(self) -> dict[str, float]:
        """Flat float dict for the registry and the weights announcement."""
        values = {f.name: float(getattr(self, f.name)) for f in fields(self) if f.name != "drift"}
        values["tokens_per_s"] = self.tokens_per_s
        return values


def loss_config(cfg: TrainerConfig) -> LossConfig:
    """The objective's hyper-parameters from the trainer settings (`kl_coef` resolved)."""
    return LossConfig(
        eps_low=cfg.eps_low,
        eps_high=cfg.eps_high,
        iw_cap=cfg.iw_cap,
        iw_cap_mode=cfg.iw_cap_mode,
        kl_coef=cfg.kl_coef or 0.0,
    )


def drift_sums(mb: MicroBatch, reference: torch.Tensor) -> dict[int, DriftSums]:
    """Reference NLL and k3 KL(behaviour || reference) sums of a micro-batch, per version."""
    import torch

    with torch.no_grad():
        d = reference - mb.logprobs
        k3 = torch.exp(d) - d - 1.0
        out: dict[int, DriftSums] = {}
        offset = 0
        for n, version in mb.segments:
            sums = DriftSums(
                n,
                -float(reference[offset : offset + n].sum()),
                float(k3[offset : offset + n].sum()),
            )
            out.setdefault(version, DriftSums()).add(sums)
            offset += n
    return out


class _Totals:
    """Running sums (and the max importance weight) over micro-batches."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys(_SUMS, 0.0)
        self.iw_max = 0.0

    def add(self, terms: LossTerms, entropy: torch.Tensor | None) -> None:
        for key, value in (
            ("loss", float(terms.loss_sum.detach())),
            ("tokens", terms.tokens),
            ("clipped", terms.clipped),
            ("masked", terms.masked),
            ("iw", terms.iw_sum),
            ("approx_kl", terms.approx_kl_sum),
            ("ref_kl", terms.ref_kl_sum),
            ("entropy", float(entropy.sum()) if entropy is not None else 0.0),
        ):
            self.sums[key] += value
        self.iw_max = max(self.iw_max, terms.iw_max)

    def reduce(self, comm: Comm) -> tuple[dict[str, float], float]:
        import torch

        sums = torch.tensor([self.sums[k] for k in _SUMS], dtype=torch.float64)
        top = torch.tensor([self.iw_max], dtype=torch.float64)
        comm.sum_(sums)
        comm.max_(top)
        return dict(zip(_SUMS, sums.tolist(), strict=True)), float(top[0])


class PPOUpdater:
    """Owns the optimizer and turns a list of samples into one policy update."""

    def __init__(self, policy: Policy, cfg: TrainerConfig, comm: Comm | None = None) -> None:
        import torch

        self.policy = policy
        self.cfg = cfg
        self.comm = comm or Comm()
        self.loss_cfg = loss_config(cfg)
        self.params = policy.trainable_parameters()
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=cfg.lr,
            betas=cfg.adam_betas,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )

    def _local(self, minibatch: list[BatchSample]) -> list[MicroBatch]:
        share = balanced_split(minibatch, self.comm.world)[self.comm.rank]
        return micro_batches(share, self.cfg.micro_batch_tokens, self.cfg.device)

    def _no_grad_logprobs(
        self, plan: list[list[MicroBatch]], fused_first: bool
    ) -> tuple[dict[tuple[int, int], torch.Tensor], dict[tuple[int, int], torch.Tensor]]:
        """Proximal (and reference) log-probs per (minibatch, micro-batch), before any step."""
        import torch

        proximal: dict[tuple[int, int], torch.Tensor] = {}
        reference: dict[tuple[int, int], torch.Tensor] = {}
        with torch.no_grad():
            for i, mbs in enumerate(plan):
                for j, mb in enumerate(mbs):
                    if not (fused_first and i == 0):
                        proximal[i, j] = completion_logprobs(self.policy.model, mb)[0]
                    if self.policy.has_reference:
                        reference[i, j] = self.policy.reference_logprobs(mb)
        return proximal, reference

    def _drift(
        self, plan: list[list[MicroBatch]], reference: dict[tuple[int, int], torch.Tensor]
    ) -> dict[int, DriftSums]:
        """Reference NLL and KL sums per served version, over every rank's share."""
        drift: dict[int, DriftSums] = {}
        for (i, j), ref in reference.items():
            for version, part in drift_sums(plan[i][j], ref).items():
                drift.setdefault(version, DriftSums()).add(part)
        return self.comm.merge_drift(drift)

    def update(self, samples: list[BatchSample]) -> UpdateStats:
        """Train on `samples` (the same list on every rank); returns global statistics."""
        import torch

        start = time.perf_counter()
        self.policy.model.train()
        minis = [m for m in balanced_split(samples, self.cfg.minibatches) if m]
        plan = [self._local(m) for m in minis]
        mini_targets = [sum(len(s.completion_token_ids) for s in m) for m in minis]
        proximal, reference = self._no_grad_logprobs(plan, self.cfg.fuse_proximal)
        drift = self._drift(plan, reference)
        totals = _Totals()
        grad_norms: list[float] = []
        for i, mbs in enumerate(plan):
            self.optimizer.zero_grad(set_to_none=True)
            for j, mb in enumerate(mbs):
                current, entropy = completion_logprobs(self.policy.model, mb, with_entropy=True)
                prox = proximal.get((i, j), current.detach())
                terms = decoupled_ppo_loss(
                    current, prox, mb.logprobs, mb.advantages, self.loss_cfg, reference.get((i, j))
                )
                (terms.loss_sum / mini_targets[i]).backward()
                totals.add(terms, entropy)
            self.comm.sum_gradients(self.params)
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
            grad_norms.append(float(norm))
            self.optimizer.step()
        sums, iw_max = totals.reduce(self.comm)
        tokens = max(sums["tokens"], 1.0)
        return UpdateStats(
            loss=sums["loss"] / tokens,
            clip_fraction=sums["clipped"] / tokens,
            iw_mean=sums["iw"] / tokens,
            iw_max=iw_max,
            masked_fraction=sums["masked"] / tokens,
            approx_kl=sums["approx_kl"] / tokens,
            ref_kl=sums["ref_kl"] / tokens,
            entropy=sums["entropy"] / tokens,
            grad_norm=max(grad_norms) if grad_norms else 0.0,
            samples=len(samples),
            completion_tokens=sum(mini_targets),
            forward_tokens=sum(len(s.prompt_token_ids) for s in samples) + sum(mini_targets),
            optimizer_steps=len(plan),
            seconds=time.perf_counter() - start,
            drift=drift,
        )

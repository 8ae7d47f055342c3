"""One policy update on one batch: proximal log-probs, decoupled PPO steps, statistics.

A batch is split into `minibatches` (one optimizer step each); each minibatch is split
across data-parallel ranks and packed into micro-batches, where an earlier turn of a
session rides in the forward pass of a later one whose prompt begins with it
(`share_prefixes`). Proximal log-probs are computed
under the weights before the first step, without gradients. Each micro-batch's loss is its
token sum divided by the *global* completion-token count of its minibatch, and gradients
are summed over ranks, so the step equals the token-level mean over the whole minibatch no
matter how it was divided.

Under the `opd` and `combine` objectives the teacher signal of each rank's share is computed
first (`liveloop.trainer.opd`), before any step, and each token's advantage is made from it
(`token_advantages`); after the steps, the student's log-probs of the taught tokens are
measured again to report how far the teacher-student gap closed.
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
from liveloop.trainer.loss import (
    AdvantageConfig,
    LossConfig,
    LossTerms,
    decoupled_ppo_loss,
    opd_term,
    token_advantages,
)
from liveloop.trainer.opd.distill import SKIP_REASONS, Distiller, TeacherSignal, make_teacher
from liveloop.trainer.policy import Policy, completion_logprobs

if TYPE_CHECKING:
    import torch

# Order of the summed statistics in the all-reduced tensor.
_SUMS = (
    "loss", "tokens", "clipped", "masked", "iw", "approx_kl", "ref_kl", "entropy", "row_tokens",
    "hinted", "opd_samples", "opd_tokens", "opd_adv", "gap_before", "gap_after",
    *(f"skip_{reason}" for reason in SKIP_REASONS),
)  # fmt: skip


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
    forward_tokens: int  # prompt + completion tokens of the samples
    row_tokens: int  # tokens run through the model (fewer where samples share prefixes)
    optimizer_steps: int
    seconds: float
    # on-policy distillation (zero under the 'rl' objective)
    hinted: int = 0  # samples with a directive hint
    opd_samples: int = 0  # samples trained with a teacher signal
    opd_advantage: float = 0.0  # mean OPD advantage applied per taught token
    opd_gap_before: float = 0.0  # mean |log pi_student - log pi_teacher|, before the update
    opd_gap_after: float | None = None  # the same after the update (None: not measured)
    opd_seconds: float = 0.0  # teacher signal + gap measurement time (slowest rank)
    opd_skipped: dict[str, int] = field(default_factory=dict)  # hinted, no signal, by reason
    lr: float = 0.0  # learning rate of this update's optimizer steps
    drift: dict[int, DriftSums] = field(default_factory=dict)  # per served version

    @property
    def tokens_per_s(self) -> float:
        """Forward tokens (prompt + completion) trained per second."""
        return self.forward_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def hint_share(self) -> float:
        """Share of the batch's samples that carried a directive hint."""
        return self.hinted / self.samples if self.samples else 0.0

    def describe(self) -> str:
        """One line for the trainer's log: size, rate, loss, speed, drift (and OPD if any)."""
        line = (
            f"{self.samples} samples, lr {self.lr:.1e}, loss {self.loss:.4f}, "
            f"{self.tokens_per_s:.0f} tok/s ({self.row_tokens} of {self.forward_tokens} run), "
            f"kl {self.approx_kl:.2e}, ref kl {self.ref_kl:.3f}, entropy {self.entropy:.2f}"
        )
        if not self.hinted:
            return line
        if not self.opd_samples and not self.opd_skipped:  # the 'rl' objective: none taught
            return f"{line}; {self.hinted} hinted"
        after = "-" if self.opd_gap_after is None else f"{self.opd_gap_after:.3f}"
        return (
            f"{line}; opd: {self.opd_samples}/{self.hinted} hinted taught, gap "
            f"{self.opd_gap_before:.3f} -> {after}, {self.opd_seconds:.1f}s"
        )

    def as_metrics(self) -> dict[str, float]:
        """Flat float dict for the registry and the weights announcement."""
        nested = ("drift", "opd_skipped", "opd_gap_after")
        values = {
            f.name: float(getattr(self, f.name)) for f in fields(self) if f.name not in nested
        }
        values["tokens_per_s"] = self.tokens_per_s
        values["hint_share"] = self.hint_share
        if self.opd_gap_after is not None:
            values["opd_gap_after"] = self.opd_gap_after
        for reason, count in self.opd_skipped.items():
            values[f"opd_skipped_{reason}"] = float(count)
        return values


def advantage_config(cfg: TrainerConfig) -> AdvantageConfig:
    """How token advantages are made, from the trainer settings."""
    return AdvantageConfig(
        objective=cfg.objective,
        rl_weight=cfg.opd.rl_weight,
        opd_weight=cfg.opd.opd_weight,
        opd_clip=cfg.opd.advantage_clip,
        opd_center=cfg.opd.center_advantages,
    )


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
                replies=1,
            )
            out.setdefault(version, DriftSums()).add(sums)
            offset += n
    return out


class _Totals:
    """Running sums (and the max importance weight) over micro-batches."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys(_SUMS, 0.0)
        self.iw_max = 0.0
        self.opd_seconds = 0.0

    def add_signal(self, signal: TeacherSignal) -> None:
        self.sums["hinted"] += signal.hinted
        self.sums["opd_samples"] += len(signal.logprobs)
        for reason, count in signal.skipped.items():
            self.sums[f"skip_{reason}"] += count
        self.opd_seconds += signal.seconds

    def add_opd(self, mb: MicroBatch, proximal: torch.Tensor, opd: torch.Tensor) -> None:
        """Statistics of the taught tokens of a micro-batch (`opd`: their applied advantage)."""
        self.sums["opd_tokens"] += float(mb.opd_mask.sum())
        self.sums["opd_adv"] += float(opd.sum())
        gap = (proximal.detach() - mb.teacher).abs() * mb.opd_mask
        self.sums["gap_before"] += float(gap.sum())

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
        top = torch.tensor([self.iw_max, self.opd_seconds], dtype=torch.float64)
        comm.sum_(sums)
        comm.max_(top)
        self.opd_seconds = float(top[1])
        return dict(zip(_SUMS, sums.tolist(), strict=True)), float(top[0])


class PPOUpdater:
    """Owns the optimizer and turns a list of samples into one policy update."""

    def __init__(
        self,
        policy: Policy,
        cfg: TrainerConfig,
        comm: Comm | None = None,
        *,
        model_name: str = "",
    ) -> None:
        import torch

        self.policy = policy
        self.cfg = cfg
        self.comm = comm or Comm()
        self.loss_cfg = loss_config(cfg)
        self.adv_cfg = advantage_config(cfg)
        self.distiller: Distiller | None = None
        if cfg.objective != "rl":
            teacher = make_teacher(
                cfg.opd, policy, cfg.micro_batch_tokens, cfg.device, model_name or "default"
            )
            self.distiller = Distiller(cfg.opd, policy, teacher)
        self.params = policy.trainable_parameters()
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=cfg.lr,
            betas=cfg.adam_betas,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )

    def drop_momentum(self) -> None:
        """Zero Adam's first moments (its running average of gradients); the second stay."""
        for state in self.optimizer.state.values():
            if "exp_avg" in state:
                state["exp_avg"].zero_()

    def close(self) -> None:
        """Release the OPD teacher (HTTP clients, threads)."""
        if self.distiller is not None:
            self.distiller.close()

    def _share(self, minibatch: list[BatchSample]) -> list[BatchSample]:
        return balanced_split(minibatch, self.comm.world)[self.comm.rank]

    def _teacher_signal(self, shares: list[list[BatchSample]]) -> TeacherSignal:
        """Teacher log-probs of this rank's hinted samples (under 'rl' only their count)."""
        if self.distiller is None:
            return TeacherSignal(hinted=sum(s.hint is not None for share in shares for s in share))
        return self.distiller.signal([s for share in shares for s in share])

    def _micro_batches(self, samples: list[BatchSample], signal: TeacherSignal) -> list[MicroBatch]:
        return micro_batches(
            samples,
            self.cfg.micro_batch_tokens,
            self.cfg.device,
            signal.logprobs,
            share=self.cfg.share_prefixes,
        )

    def _gap_after(self, shares: list[list[BatchSample]], signal: TeacherSignal) -> float:
        """Sum of |log pi_student - log pi_teacher| over the taught tokens, after the steps."""
        import torch

        taught = [s for share in shares for s in share if s.key in signal.logprobs]
        total = 0.0
        with torch.no_grad():
            for mb in self._micro_batches(taught, signal):
                after = completion_logprobs(self.policy.model, mb)[0]
                total += float(((after - mb.teacher).abs() * mb.opd_mask).sum())
        return total

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

    def update(self, samples: list[BatchSample], lr_scale: float = 1.0) -> UpdateStats:
        """Train on `samples` (the same list on every rank) at `lr_scale` times the
        configured learning rate; returns global statistics."""
        import torch

        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * lr_scale
        start = time.perf_counter()
        self.policy.model.train()
        minis = [m for m in balanced_split(samples, self.cfg.minibatches) if m]
        shares = [self._share(m) for m in minis]
        totals = _Totals()
        signal = self._teacher_signal(shares)
        totals.add_signal(signal)
        plan = [self._micro_batches(share, signal) for share in shares]
        totals.sums["row_tokens"] = sum(mb.num_tokens for mbs in plan for mb in mbs)
        mini_targets = [sum(len(s.completion_token_ids) for s in m) for m in minis]
        proximal, reference = self._no_grad_logprobs(plan, self.cfg.fuse_proximal)
        drift = self._drift(plan, reference)
        grad_norms: list[float] = []
        for i, mbs in enumerate(plan):
            self.optimizer.zero_grad(set_to_none=True)
            for j, mb in enumerate(mbs):
                current, entropy = completion_logprobs(self.policy.model, mb, with_entropy=True)
                prox = proximal.get((i, j), current.detach())
                opd = None
                if self.adv_cfg.objective != "rl":
                    lengths = [n for n, _version in mb.segments]
                    opd = opd_term(mb.teacher, prox, mb.opd_mask, self.adv_cfg, lengths)
                advantages = token_advantages(mb.advantages, opd, self.adv_cfg)
                terms = decoupled_ppo_loss(
                    current, prox, mb.logprobs, advantages, self.loss_cfg, reference.get((i, j))
                )
                (terms.loss_sum / mini_targets[i]).backward()
                totals.add(terms, entropy)
                if signal.logprobs and opd is not None:
                    totals.add_opd(mb, prox, opd)
            self.comm.sum_gradients(self.params)
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
            grad_norms.append(float(norm))
            self.optimizer.step()
        measure_after = bool(signal.logprobs) and self.cfg.opd.measure_gap_after
        if measure_after:
            after_start = time.perf_counter()
            totals.sums["gap_after"] += self._gap_after(shares, signal)
            totals.opd_seconds += time.perf_counter() - after_start
        sums, iw_max = totals.reduce(self.comm)
        tokens = max(sums["tokens"], 1.0)
        opd_tokens = max(sums["opd_tokens"], 1.0)
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
            row_tokens=int(sums["row_tokens"]),
            optimizer_steps=len(plan),
            seconds=time.perf_counter() - start,
            hinted=int(sums["hinted"]),
            opd_samples=int(sums["opd_samples"]),
            opd_advantage=sums["opd_adv"] / opd_tokens,
            opd_gap_before=sums["gap_before"] / opd_tokens,
            opd_gap_after=(
                sums["gap_after"] / opd_tokens
                if self.cfg.opd.measure_gap_after and sums["opd_samples"]
                else None
            ),
            opd_seconds=totals.opd_seconds,
            opd_skipped={r: int(sums[f"skip_{r}"]) for r in SKIP_REASONS if sums[f"skip_{r}"] > 0},
            lr=self.cfg.lr * lr_scale,
            drift=drift,
        )

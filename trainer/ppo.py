"""One policy update on one batch: proximal log-probs, decoupled PPO steps, statistics.

A batch is split into `minibatches` (`tenant_minibatches` in tenant scope), one optimizer
step each; each minibatch is split across data-parallel ranks and packed into
micro-batches, where an earlier turn of a session rides in the forward pass of a later one
whose prompt begins with it (`share_prefixes`). Proximal log-probs are computed under the
weights before the first step, without gradients. Each micro-batch's loss is its
token sum divided by the *global* completion-token count of its minibatch, and gradients
are summed over ranks, so the step equals the token-level mean over the whole minibatch no
matter how it was divided.

What each token's advantage is belongs to the objective (`liveloop.trainer.objectives`):
it may prepare a per-token signal for its rank's share before any step (a teacher's
log-probs), turns each micro-batch's tokens into advantages, may measure something after the
steps, and keeps its own statistics, which are summed over ranks here without being read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from liveloop.config.trainer import TrainerConfig
from liveloop.contracts import BatchSample
from liveloop.quality import DriftSums
from liveloop.trainer.data import MicroBatch, balanced_split, micro_batches
from liveloop.trainer.dist import Comm
from liveloop.trainer.loss import LossConfig, LossTerms, decoupled_ppo_loss
from liveloop.trainer.objectives import (
    Objective,
    ObjectiveContext,
    ObjectiveReport,
    TokenInputs,
    TokenSignal,
    build_objective,
)
from liveloop.trainer.policy import Policy, completion_logprobs

if TYPE_CHECKING:
    import torch

# Order of the summed statistics in the all-reduced tensor (the objective's follow).
_SUMS = (
    "loss", "tokens", "clipped", "masked", "iw", "approx_kl", "ref_kl", "entropy", "row_tokens",
    "hinted",
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
    hinted: int = 0  # samples with a directive hint
    objective: ObjectiveReport = field(default_factory=ObjectiveReport)  # its own figures
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
        """One line for the trainer's log: size, rate, loss, speed, drift, the objective's note."""
        line = (
            f"{self.samples} samples, lr {self.lr:.1e}, loss {self.loss:.4f}, "
            f"{self.tokens_per_s:.0f} tok/s ({self.row_tokens} of {self.forward_tokens} run), "
            f"kl {self.approx_kl:.2e}, ref kl {self.ref_kl:.3f}, entropy {self.entropy:.2f}"
        )
        if self.objective.note:
            return f"{line}; {self.objective.note}"
        return f"{line}; {self.hinted} hinted" if self.hinted else line

    def as_metrics(self) -> dict[str, float]:
        """Flat float dict for the registry and the weights announcement."""
        plain = ("loss", "clip_fraction", "iw_mean", "iw_max", "masked_fraction", "approx_kl",
                 "ref_kl", "entropy", "grad_norm", "samples", "completion_tokens",
                 "forward_tokens", "row_tokens", "optimizer_steps", "seconds", "hinted", "lr")  # fmt: skip
        values = {name: float(getattr(self, name)) for name in plain}
        values["tokens_per_s"] = self.tokens_per_s
        values["hint_share"] = self.hint_share
        values.update(self.objective.metrics)
        return values


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

    def reduce(
        self, comm: Comm, objective: Objective
    ) -> tuple[dict[str, float], float, ObjectiveReport]:
        """Sums over every rank (ours and the objective's), the max weight, its report."""
        import torch

        tally = objective.tally
        sum_keys, max_keys = [*_SUMS, *tally.sums], list(tally.maxima)
        values = [*self.sums.values(), *tally.sums.values()]
        sums = torch.tensor(values, dtype=torch.float64)
        top = torch.tensor([self.iw_max, *tally.maxima.values()], dtype=torch.float64)
        comm.sum_(sums)
        comm.max_(top)
        reduced = dict(zip(sum_keys, sums.tolist(), strict=True))
        peaks = dict(zip(max_keys, top.tolist()[1:], strict=True))
        objective_sums = {k: reduced[k] for k in tally.sums}
        return reduced, float(top[0]), objective.report(objective_sums, peaks)


class PPOUpdater:
    """Owns the optimizer and the objective, and turns a list of samples into one update."""

    def __init__(
        self,
        policy: Policy,
        cfg: TrainerConfig,
        comm: Comm | None = None,
        *,
        model_name: str = "",
        cache: dict[str, Any] | None = None,
        tool_result_reminder: str = "",
    ) -> None:
        import torch

        self.policy = policy
        self.cfg = cfg
        self.comm = comm or Comm()
        self.loss_cfg = LossConfig.of(cfg)
        context = ObjectiveContext(
            policy,
            cfg,
            model_name,
            cache={} if cache is None else cache,
            tool_result_reminder=tool_result_reminder,
        )
        self.objective = build_objective(context)
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
        """Release what the objective holds (a teacher's HTTP clients, threads)."""
        self.objective.close()

    def _share(self, minibatch: list[BatchSample]) -> list[BatchSample]:
        return balanced_split(minibatch, self.comm.world)[self.comm.rank]

    def _micro_batches(self, samples: list[BatchSample], signal: TokenSignal) -> list[MicroBatch]:
        return micro_batches(
            samples,
            self.cfg.micro_batch_tokens,
            self.cfg.device,
            signal,
            share=self.cfg.share_prefixes,
        )

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

    def _step(
        self,
        mbs: list[MicroBatch],
        proximal: dict[int, torch.Tensor],
        reference: dict[int, torch.Tensor],
        target_tokens: int,
        totals: _Totals,
    ) -> float:
        """One optimizer step over a minibatch's micro-batches; returns the gradient norm."""
        import torch

        self.optimizer.zero_grad(set_to_none=True)
        for j, mb in enumerate(mbs):
            current, entropy = completion_logprobs(self.policy.model, mb, with_entropy=True)
            prox = proximal.get(j, current.detach())
            tokens = TokenInputs(
                scalar=mb.advantages,
                proximal=prox.detach(),
                signal=mb.signal,
                signal_mask=mb.signal_mask,
                lengths=[n for n, _version in mb.segments],
            )
            advantages = self.objective.advantages(tokens)
            terms = decoupled_ppo_loss(
                current, prox, mb.logprobs, advantages, self.loss_cfg, reference.get(j)
            )
            (terms.loss_sum / target_tokens).backward()
            totals.add(terms, entropy)
        self.comm.sum_gradients(self.params)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optimizer.step()
        return float(norm)

    def update(self, samples: list[BatchSample], lr_scale: float = 1.0) -> UpdateStats:
        """Train on `samples` (the same list on every rank) at `lr_scale` times the
        configured learning rate; returns global statistics."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * lr_scale
        start = time.perf_counter()
        self.policy.model.train()
        minis = [m for m in balanced_split(samples, self.cfg.steps_per_batch) if m]
        mine = [s for m in minis for s in self._share(m)]  # this rank's share, all minibatches
        totals = _Totals()
        self.objective.tally.reset()
        totals.sums["hinted"] = sum(s.hint is not None for s in mine)
        signal = self.objective.prepare(mine)
        plan = [self._micro_batches(self._share(m), signal) for m in minis]
        totals.sums["row_tokens"] = sum(mb.num_tokens for mbs in plan for mb in mbs)
        mini_targets = [sum(len(s.completion_token_ids) for s in m) for m in minis]
        proximal, reference = self._no_grad_logprobs(plan, self.cfg.fuse_proximal)
        drift = self._drift(plan, reference)
        grad_norms = [
            self._step(
                mbs,
                {j: t for (k, j), t in proximal.items() if k == i},
                {j: t for (k, j), t in reference.items() if k == i},
                mini_targets[i],
                totals,
            )
            for i, mbs in enumerate(plan)
        ]
        self.objective.after_steps(mine, signal)
        sums, iw_max, report = totals.reduce(self.comm, self.objective)
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
            row_tokens=int(sums["row_tokens"]),
            optimizer_steps=len(plan),
            seconds=time.perf_counter() - start,
            hinted=int(sums["hinted"]),
            objective=report,
            lr=self.cfg.lr * lr_scale,
            drift=drift,
        )

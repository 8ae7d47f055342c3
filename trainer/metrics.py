"""Prometheus metrics of the training loop, created on a registry passed in (never global)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from liveloop.trainer.ppo import UpdateStats
    from liveloop.trainer.safeguards.probing import ProbeResult

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
WAIT_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)
DROP_REASONS = ("stale", "invalid", "duplicate_batch", "too_few")


class TrainerMetrics:
    """Loss, PPO diagnostics, throughput, staleness and batch wait of `liveloop train`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        g = self._gauge
        self.version = g("version", "Current policy version.")
        self.loss = g("loss", "Loss of the last update.")
        self.clip_fraction = g("clip_fraction", "Tokens where the clipped branch won.")
        self.iw_mean = g("iw_mean", "Mean behaviour importance weight.")
        self.iw_max = g("iw_max", "Max behaviour importance weight.")
        self.masked_fraction = g(
            "iw_capped_fraction", "Tokens whose importance weight exceeded the cap."
        )
        self.approx_kl = g("approx_kl", "k3 KL(proximal || current), last update.")
        self.ref_kl = g("ref_kl", "k3 KL to the reference (0 without one).")
        self.entropy = g("entropy", "Mean token entropy.")
        self.grad_norm = g("grad_norm", "Gradient norm before clipping.")
        self.tokens_per_s = g("tokens_per_second", "Forward tokens per second.")
        self.publish_seconds = g("publish_seconds", "Checkpoint write + announce time.")
        r = self.registry
        self.updates = Counter("liveloop_trainer_updates", "Policy updates.", registry=r)
        self.tokens = Counter("liveloop_trainer_tokens", "Forward tokens trained.", registry=r)
        self.samples = Counter("liveloop_trainer_samples", "Samples trained.", registry=r)
        self.dropped = Counter(
            "liveloop_trainer_dropped_samples",
            (
                "Samples not trained on, by reason (stale, invalid, duplicate_batch, too_few, "
                "and the objective's own, such as flat)."
            ),
            ["reason"],
            registry=r,
        )
        for reason in DROP_REASONS:  # exported at 0 from the start (rate() shows 0, not no data)
            self.dropped.labels(reason)
        self.staleness = Histogram(
            "liveloop_trainer_staleness",
            "Versions between a trained sample's oldest token and the trainer.",
            buckets=STALENESS_BUCKETS,
            registry=r,
        )
        self.batch_wait = Histogram(
            "liveloop_trainer_batch_wait_seconds",
            "Time from a batch's creation to the start of its update.",
            buckets=WAIT_BUCKETS,
            registry=r,
        )

        self._objective_metrics()
        self.gate_verdicts = Counter(
            "liveloop_gate_verdicts",
            "Promotion-gate verdicts on new versions, by outcome (accepted, rejected).",
            ["outcome"],
            registry=r,
        )
        for outcome in ("accepted", "rejected"):
            self.gate_verdicts.labels(outcome)
        self.rollbacks = Counter(
            "liveloop_trainer_rollbacks",
            "Rollbacks by the served-quality watch (a version's served reward fell, or its "
            "replies drifted from the reference).",
            registry=r,
        )
        self.gate_seconds = Gauge(
            "liveloop_gate_seconds", "Time the last gate evaluation took.", registry=r
        )
        self.probe = Gauge(
            "liveloop_gate_probe",
            "The last candidate's probe measures (reward, ref_nll, kl_ref, topic_rate, words).",
            ["measure"],
            registry=r,
        )

    def _objective_metrics(self) -> None:
        r = self.registry
        self.hint_share = self._gauge(
            "hint_share", "Share of the last batch's samples with a directive hint."
        )
        self.hinted = Counter(
            "liveloop_trainer_hinted_samples", "Samples with a directive hint.", registry=r
        )
        self.objective = Gauge(
            "liveloop_trainer_objective",
            "The training objective's own figures of the last update, by measure (for 'opd' "
            "and 'combine': opd_samples, opd_advantage, opd_gap_before, opd_gap_after, "
            "opd_seconds, opd_skipped_<reason>).",
            ["measure"],
            registry=r,
        )

    def observe_objective(self, stats: UpdateStats) -> None:
        """Record the hints of one update and its objective's own figures."""
        self.hint_share.set(stats.hint_share)
        self.hinted.inc(stats.hinted)
        for measure, value in stats.objective.metrics.items():
            self.objective.labels(measure).set(value)

    def observe_gate(self, accepted: bool, probe: ProbeResult) -> None:
        """Record one gate verdict and the candidate's probe measures."""
        self.gate_verdicts.labels("accepted" if accepted else "rejected").inc()
        self.gate_seconds.set(probe.seconds)
        for name, value in (
            ("reward", probe.reward),
            ("ref_nll", probe.ref_nll),
            ("kl_ref", probe.kl_ref),
            ("topic_rate", probe.topic_rate),
            ("words", probe.mean_words),
        ):
            if value is not None:
                self.probe.labels(name).set(value)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"liveloop_trainer_{name}", doc, registry=self.registry)

    def observe_update(self, stats: UpdateStats, version: int) -> None:
        """Record one finished update."""
        self.version.set(version)
        self.updates.inc()
        self.loss.set(stats.loss)
        self.clip_fraction.set(stats.clip_fraction)
        self.iw_mean.set(stats.iw_mean)
        self.iw_max.set(stats.iw_max)
        self.masked_fraction.set(stats.masked_fraction)
        self.approx_kl.set(stats.approx_kl)
        self.ref_kl.set(stats.ref_kl)
        self.entropy.set(stats.entropy)
        self.grad_norm.set(stats.grad_norm)
        self.tokens_per_s.set(stats.tokens_per_s)
        self.tokens.inc(stats.forward_tokens)
        self.samples.inc(stats.samples)
        self.observe_objective(stats)

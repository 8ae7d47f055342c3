"""Prometheus metrics of the training loop, created on a registry passed in (never global)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from trainer.ppo import UpdateStats

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
WAIT_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)


class TrainerMetrics:
    """Loss, PPO diagnostics, throughput, staleness and batch wait of `liveloop train`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.version = Gauge("liveloop_trainer_version", "Current policy version.", registry=r)
        self.updates = Counter("liveloop_trainer_updates", "Policy updates.", registry=r)
        self.loss = Gauge("liveloop_trainer_loss", "Loss of the last update.", registry=r)
        self.clip_fraction = Gauge(
            "liveloop_trainer_clip_fraction", "Tokens where the clipped branch won.", registry=r
        )
        self.iw_mean = Gauge(
            "liveloop_trainer_iw_mean", "Mean behaviour importance weight.", registry=r
        )
        self.iw_max = Gauge(
            "liveloop_trainer_iw_max", "Max behaviour importance weight.", registry=r
        )
        self.masked_fraction = Gauge(
            "liveloop_trainer_iw_capped_fraction",
            "Tokens whose importance weight exceeded the cap.",
            registry=r,
        )
        self.approx_kl = Gauge(
            "liveloop_trainer_approx_kl", "k3 KL(proximal || current), last update.", registry=r
        )
        self.ref_kl = Gauge(
            "liveloop_trainer_ref_kl", "k3 KL to the reference (0 without one).", registry=r
        )
        self.entropy = Gauge("liveloop_trainer_entropy", "Mean token entropy.", registry=r)
        self.grad_norm = Gauge(
            "liveloop_trainer_grad_norm", "Gradient norm before clipping.", registry=r
        )
        self.tokens_per_s = Gauge(
            "liveloop_trainer_tokens_per_second", "Forward tokens per second.", registry=r
        )
        self.tokens = Counter("liveloop_trainer_tokens", "Forward tokens trained.", registry=r)
        self.samples = Counter("liveloop_trainer_samples", "Samples trained.", registry=r)
        self.dropped = Counter(
            "liveloop_trainer_dropped_samples",
            "Samples not trained on, by reason.",
            ["reason"],
            registry=r,
        )
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
        self.publish_seconds = Gauge(
            "liveloop_trainer_publish_seconds", "Checkpoint write + announce time.", registry=r
        )

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

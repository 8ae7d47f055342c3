"""Prometheus metrics of the judging loop, created on a registry the caller owns."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SCORE_BUCKETS = (-1.0, -0.75, -0.5, -0.25, -0.001, 0.001, 0.25, 0.5, 0.75, 1.0)
LATENCY_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SHARE_BUCKETS = (0.0, 0.1, 0.2, 0.34, 0.5, 0.67, 0.8, 1.0)
TURN_OUTCOMES = ("scored", "side", "unscored", "duplicate", "missing", "dead_letter")
SIGNALS = ("next_turn", "feedback", "timeout")
FEEDBACK_OUTCOMES = ("paired", "stored", "late")


class PrmMetrics:
    """Judge latency and scores per judge, stream lag, dead letters and turn outcomes.

    `turns_total{outcome}` counts what happened to each consumed turn: `scored`, `side`
    (never trainable), `unscored` (no judge had an opinion), `duplicate` (already seen),
    `missing` (pairing state gone) and `dead_letter`. `scored_total{signal}` splits the scored
    ones by next-state signal (`next_turn`, `feedback`, `timeout`).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._judge_metrics(registry)
        self._stream_metrics(registry)
        # Known label values are exported at 0 from the start (rate() shows 0, not no data).
        for labelled, values in (
            (self.turns, TURN_OUTCOMES),
            (self.scored, SIGNALS),
            (self.feedback, FEEDBACK_OUTCOMES),
        ):
            for value in values:
                labelled.labels(value)

    def _judge_metrics(self, registry: CollectorRegistry) -> None:
        self.judge_latency = Histogram(
            "liveloop_prm_judge_latency_seconds",
            "Time one judge took to score one turn.",
            ["judge"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.judge_score = Histogram(
            "liveloop_prm_judge_score",
            "Scores given by each judge (label 'final' = the combined score written).",
            ["judge"],
            buckets=SCORE_BUCKETS,
            registry=registry,
        )
        self.judge_failures = Counter(
            "liveloop_prm_judge_failures_total",
            "Judge calls that raised, timed out or returned an invalid result.",
            ["judge"],
            registry=registry,
        )
        self.directive_hints = Counter(
            "liveloop_prm_directive_hints_total",
            "Verdicts carrying a directive hint, by judge ('final' = the combined verdicts).",
            ["judge"],
            registry=registry,
        )
        self.votes_disagreement = Histogram(
            "liveloop_prm_votes_disagreement",
            "Share of a voting judge's votes that differ from its majority.",
            ["judge"],
            buckets=SHARE_BUCKETS,
            registry=registry,
        )

    def _stream_metrics(self, registry: CollectorRegistry) -> None:
        self.turns = Counter(
            "liveloop_prm_turns_total",
            "Turns by outcome: scored, side, unscored, duplicate, missing, dead_letter.",
            ["outcome"],
            registry=registry,
        )
        self.scored = Counter(
            "liveloop_prm_scored_total",
            "Scored turns by next-state signal: next_turn, feedback, timeout.",
            ["signal"],
            registry=registry,
        )
        self.feedback = Counter(
            "liveloop_prm_feedback_total",
            "Explicit feedback by outcome: paired, stored (turn not seen yet), late.",
            ["outcome"],
            registry=registry,
        )
        self.dead_letters = Counter(
            "liveloop_prm_dead_letters_total",
            "Entries moved to a dead-letter stream.",
            ["stream"],
            registry=registry,
        )
        self.lag = Gauge(
            "liveloop_prm_consumer_lag",
            "Entries of a stream not yet delivered to the consumer group.",
            ["stream"],
            registry=registry,
        )
        self.pending = Gauge(
            "liveloop_prm_consumer_pending",
            "Entries of a stream delivered but not yet acknowledged.",
            ["stream"],
            registry=registry,
        )
        self.waiting = Gauge(
            "liveloop_prm_waiting_turns",
            "Turns waiting for their next state.",
            registry=registry,
        )

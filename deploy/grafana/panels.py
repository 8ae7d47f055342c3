"""The panels of LiveLoop's four dashboards: what each shows and the PromQL behind it.

Queries aggregate away replica labels except where a panel is per replica, and select
`job` only for `up` (the scrape configs of compose and the Helm chart name the jobs
`liveloop-serve`, `liveloop-judge`, `liveloop-collect` and `liveloop-train`). Gauges of
the stream exporter are taken with `max` because every collector replica exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RATE = "[$__rate_interval]"
Query = tuple[str, str]  # (PromQL, legend)


@dataclass(frozen=True)
class PanelSpec:
    """One panel: title, help text, (PromQL, legend) pairs and display settings."""

    title: str
    description: str
    queries: list[Query]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat | bargauge
    width: int = 8
    height: int = 8
    min: float | None = None
    thresholds: list[tuple[float, str]] = field(default_factory=list)


@dataclass(frozen=True)
class RowSpec:
    """A titled row of panels."""

    title: str
    panels: list[PanelSpec]


@dataclass(frozen=True)
class DashboardSpec:
    """A dashboard: fixed uid, file name, title and rows."""

    uid: str
    slug: str
    title: str
    description: str
    rows: list[RowSpec]


def quantiles(metric: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[Query]:
    """p50/p90/p99 of a histogram (optionally per label `by`)."""
    labels = f"le, {by}" if by else "le"
    prefix = f"{{{{{by}}}}} " if by else ""
    return [
        (
            f"histogram_quantile({q}, sum by ({labels}) (rate({metric}_bucket{RATE})))",
            f"{prefix}p{round(q * 100)}",
        )
        for q in qs
    ]


def rate_by(metric: str, by: str, scale: str = "") -> Query:
    """Per-second rate of a counter, summed per label value."""
    return f"sum by ({by}) (rate({metric}{RATE})){scale}", f"{{{{{by}}}}}"


def ratio(num: str, den: str, by: str = "") -> str:
    """Mean of a summary/histogram over the rate window: rate(sum) / rate(count)."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({num}{RATE})) / sum{grouping} (rate({den}{RATE}))"


def by_stream_group(metric: str) -> Query:
    """A stream-exporter gauge per (stream, group)."""
    return f"max by (stream, group) ({metric})", "{{stream}} / {{group}}"


def quality(measure: str, prefix: str = "") -> Query:
    """One measure of `liveloop_quality` per policy version (the trainer exports the newest)."""
    legend = f"{prefix} v{{{{version}}}}" if prefix else "v{{version}}"
    return f'max by (version) (liveloop_quality{{measure="{measure}"}})', legend


P = PanelSpec
SERVE_UP = 'up{job="liveloop-serve"}'
REFUSED = 'sum by (instance) (increase(liveloop_weight_swaps_total{outcome="refused"}[$__range]))'


# Score histograms have negative buckets, so the Prometheus client exports no _sum for
# them: verdicts are read from the buckets (le="-0.001": negative, le="0.001": not positive).
def _final(suffix: str, le: str = "") -> str:
    labels = f'judge="final", le="{le}"' if le else 'judge="final"'
    return f"sum(rate(liveloop_prm_judge_score_{suffix}{{{labels}}}{RATE}))"


JUDGED_MEDIAN = (
    "histogram_quantile(0.5, sum by (le) "
    f'(rate(liveloop_prm_judge_score_bucket{{judge="final"}}{RATE})))'
)
VERDICTS = [
    (f"{_final('count')} - {_final('bucket', '0.001')}", "positive"),
    (f"{_final('bucket', '0.001')} - {_final('bucket', '-0.001')}", "neutral"),
    (_final("bucket", "-0.001"), "negative"),
]

# fmt: off
SERVING = DashboardSpec(
    "liveloop-serving", "serving", "LiveLoop / Serving",
    "Latency, throughput, load, errors, and the health and policy version of each serving "
    "replica.",
    [
        RowSpec("Latency", [
            P("Time to first token", "Request arrival to the first generated token.",
              quantiles("liveloop_time_to_first_token_seconds"), unit="s"),
            P("Inter-token latency", "Time between two tokens of one sample.",
              quantiles("liveloop_inter_token_latency_seconds"), unit="s"),
            P("End-to-end latency", "Request arrival to its last token.",
              quantiles("liveloop_e2e_request_latency_seconds"), unit="s"),
        ]),
        RowSpec("Throughput and load", [
            P("Tokens per second", "Completion and prompt tokens per second, all replicas.",
              [(f"sum(rate(liveloop_completion_tokens_total{RATE}))", "completion"),
               (f"sum(rate(liveloop_prompt_tokens_total{RATE}))", "prompt")]),
            P("Finished samples by reason", "Samples per second by finish reason (stop, "
              "length, tool_calls, abort).", [rate_by("liveloop_requests_total", "finish_reason")],
              unit="reqps"),
            P("Running and queued", "Sequences being decoded and waiting for a slot, per replica.",
              [("sum by (instance) (liveloop_requests_running)", "running {{instance}}"),
               ("sum by (instance) (liveloop_requests_queued)", "queued {{instance}}")]),
            P("Errors by type", "Error responses per second by OpenAI error type; 4xx types are "
              "the clients', server_error is ours.", [rate_by("liveloop_errors_total", "type")],
              unit="reqps"),
            P("Prompt building", "Prompts extended token-exactly from the previous turn vs built "
              "fresh.", [rate_by("liveloop_prompt_mode_total", "mode")], unit="reqps"),
        ]),
        RowSpec("Replicas", [
            P("Replica up", "1 while Prometheus scrapes the replica.", [(SERVE_UP, "{{instance}}")],
              kind="stat", min=0, thresholds=[(1, "green")]),
            P("Serving version per replica", "Policy version each replica serves.",
              [("max by (instance) (liveloop_policy_version)", "{{instance}}")], kind="stat"),
            P("Trace capture", "1 while the replica records turns (admins can pause it).",
              [("max by (instance) (liveloop_trace_capture_enabled)", "{{instance}}")],
              kind="stat"),
        ]),
    ],
)

PIPELINE = DashboardSpec(
    "liveloop-pipeline", "pipeline", "LiveLoop / Pipeline",
    "The streams between the loops (lengths, consumer lag and pending entries per group, dead "
    "letters), the trace spool, judging and collecting.",
    [
        RowSpec("Streams", [
            P("Stream lengths", "Entries in each stream.",
              [("max by (stream) (liveloop_stream_length)", "{{stream}}")]),
            P("Consumer lag", "Entries not yet delivered to each consumer group.",
              [by_stream_group("liveloop_stream_group_lag")]),
            P("Oldest undelivered entry", "Age of the oldest entry each group has not read yet.",
              [by_stream_group("liveloop_stream_group_lag_seconds")], unit="s"),
            P("Pending entries", "Delivered to a group but not acknowledged: being processed, or "
              "held by a dead consumer until reclaimed.",
              [by_stream_group("liveloop_stream_group_pending")]),
            P("Consumers per group", "Consumers registered in each group.",
              [by_stream_group("liveloop_stream_group_consumers")]),
            P("Dead letters", "Entries in each stream's :dlq twin (they failed too often).",
              [("max by (stream) (liveloop_stream_dead_letters)", "{{stream}}")]),
        ]),
        RowSpec("Trace spool", [
            P("Spool backlog", "Turn records on a replica's disk waiting for Redis.",
              [("sum by (instance) (liveloop_trace_spool_backlog)", "{{instance}}")]),
            P("Trace records", "Turn records per second by outcome.",
              [rate_by("liveloop_trace_records_total", "outcome")], unit="ops"),
            P("Bus reachable", "1 while Redis answers the stream exporter.",
              [("min(liveloop_bus_up)", "bus")], kind="stat", min=0),
        ]),
        RowSpec("Judging", [
            P("Judge latency", "Time one judge takes for one turn.",
              quantiles("liveloop_prm_judge_latency_seconds", "judge", (0.5, 0.99)), unit="s"),
            P("Verdicts", "Combined scores written to liveloop:scored per second: positive, "
              "neutral (|score| < 0.001) and negative.", VERDICTS, unit="ops"),
            P("Median score by judge", "Median score each judge gives ('final' is the combined "
              "score).", quantiles("liveloop_prm_judge_score", "judge", (0.5,))),
            P("Turns by outcome", "What happened to consumed turns: scored, side, unscored, "
              "duplicate, missing, dead_letter.", [rate_by("liveloop_prm_turns_total", "outcome")],
              unit="ops"),
            P("Scored by next-state signal", "next_turn, feedback or timeout.",
              [rate_by("liveloop_prm_scored_total", "signal")], unit="ops"),
            P("Explicit feedback", "Feedback by outcome: paired, stored, late.",
              [rate_by("liveloop_prm_feedback_total", "outcome")], unit="ops"),
            P("Judge failures", "Judge calls that raised, timed out or returned an invalid result.",
              [rate_by("liveloop_prm_judge_failures_total", "judge")], unit="ops"),
            P("Turns waiting for a next state", "Turns held until the session's next turn, "
              "feedback or the timeout.", [("sum(liveloop_prm_waiting_turns)", "waiting")]),
        ]),
        RowSpec("Collecting", [
            P("Collected and batched turns", "Scored turns read, batched and dropped (by reason) "
              "per second.",
              [(f"sum(rate(liveloop_collector_turns_total{RATE}))", "read"),
               (f"sum(rate(liveloop_collector_batched_turns_total{RATE}))", "batched"),
               rate_by("liveloop_collector_dropped_turns_total", "reason")], unit="ops"),
            P("Batch wait", "Oldest turn's arrival to its batch being published.",
              quantiles("liveloop_collector_batch_wait_seconds", qs=(0.5, 0.99)), unit="s"),
            P("Turns waiting for a batch", "Turns held in groups or for a batch.",
              [("sum(liveloop_collector_pending_turns)", "pending")]),
        ]),
    ],
)

LEARNING = DashboardSpec(
    "liveloop-learning", "learning", "LiveLoop / Learning",
    "Is the policy getting better? Reward per version and over time, staleness, and the "
    "trainer's PPO diagnostics.",
    [
        RowSpec("Reward", [
            P("Reward per policy version", "Mean judged score of turns, by the version that "
              "produced most of their tokens.",
              [("sum by (version) (liveloop_collector_reward_sum) / sum by (version) "
                "(liveloop_collector_reward_count)", "v{{version}}")], kind="bargauge", width=12),
            P("Reward over time", "Median combined score of judged turns, and the share of "
              "them judged positive.",
              [(JUDGED_MEDIAN, "judged median"),
               (f'({_final("count")} - {_final("bucket", "0.001")}) / {_final("count")}',
                "positive share")], width=12),
            P("Policy version", "The trainer's newest version, and updates per minute.",
              [("max(liveloop_trainer_version)", "version"),
               (f"sum(rate(liveloop_trainer_updates_total{RATE})) * 60", "updates / min")]),
            P("Running baseline", "Reward baseline per judge (advantage = score - baseline when "
              "no group shares a prompt).",
              [("max by (judge) (liveloop_collector_baseline)", "{{judge}}")]),
            P("Staleness", "Versions between a sample's oldest token and the trainer.",
              [*quantiles("liveloop_trainer_staleness", qs=(0.5, 0.99)),
               (f"histogram_quantile(0.99, sum by (le) "
                f"(rate(liveloop_collector_staleness_bucket{RATE})))", "collector p99")]),
        ]),
        RowSpec("Trainer", [
            P("Loss", "Loss of the last update.", [("max(liveloop_trainer_loss)", "loss")]),
            P("Clip fraction", "Tokens where the clipped branch of the PPO loss won.",
              [("max(liveloop_trainer_clip_fraction)", "clip fraction")], unit="percentunit"),
            P("Importance weights", "Behaviour importance weight exp(proximal - behaviour): "
              "mean, max, and the share over the cap.",
              [("max(liveloop_trainer_iw_mean)", "mean"), ("max(liveloop_trainer_iw_max)", "max"),
               ("max(liveloop_trainer_iw_capped_fraction)", "capped fraction")]),
            P("KL", "k3 estimates: proximal to current policy, and to the reference (0 without "
              "one).", [("max(liveloop_trainer_approx_kl)", "proximal || current"),
                        ("max(liveloop_trainer_ref_kl)", "reference")]),
            P("Entropy", "Mean token entropy of the trained samples.",
              [("max(liveloop_trainer_entropy)", "entropy")]),
            P("Trained tokens per second", "Forward tokens per second during an update, and "
              "averaged over time.",
              [("max(liveloop_trainer_tokens_per_second)", "during updates"),
               (f"sum(rate(liveloop_trainer_tokens_total{RATE}))", "average")]),
            P("Gradient norm", "Before clipping.", [("max(liveloop_trainer_grad_norm)", "norm")]),
            P("Dropped samples", "Samples not trained on, by reason, in the trainer and the "
              "collector.",
              [rate_by("liveloop_trainer_dropped_samples_total", "reason"),
               (f"sum by (reason) (rate(liveloop_collector_dropped_turns_total{RATE}))",
                "collector {{reason}}")], unit="ops"),
            P("Batch wait in the trainer", "Batch creation to the start of its update.",
              quantiles("liveloop_trainer_batch_wait_seconds", qs=(0.5, 0.99)), unit="s"),
        ]),
        RowSpec("Quality on served traffic and the promotion gate", [
            P("Served reward per version", "Mean judged reward of the turns each version "
              "served (the newest versions).", [quality("mean_reward")], kind="bargauge"),
            P("Reference NLL and KL per version", "Reference model's NLL per token of each "
              "version's replies, and k3 KL to the reference: drift away from fluent text.",
              [quality("ref_nll", "NLL"), quality("kl_ref", "KL")], kind="bargauge"),
            P("Reply length and diversity per version", "Mean reply words and distinct-2; "
              "collapsing diversity or exploding length are reward hacking.",
              [quality("mean_reply_words", "words"), quality("distinct_2", "distinct-2")],
              kind="bargauge"),
            P("Unscored share per version", "Share of each version's turns no judge could "
              "score.", [quality("unscored_share")], kind="bargauge", unit="percentunit"),
            P("Promotion gate verdicts and rollbacks", "Candidate versions the gate "
              "accepted or rejected in the time range (rejected versions are never served), "
              "and served versions the served-quality watch rolled back.",
              [("sum by (outcome) (increase(liveloop_gate_verdicts_total[$__range]))",
                "{{outcome}}"),
               ("sum(increase(liveloop_trainer_rollbacks_total[$__range]))", "rolled back")],
              kind="stat"),
            P("Last candidate's probe", "The gate's measures of the last candidate (reward, "
              "reference NLL, KL, topic rate, words).",
              [("max by (measure) (liveloop_gate_probe)", "{{measure}}")], kind="bargauge"),
        ]),
        RowSpec("Tenants (tenant scope: one adapter per tenant, the busiest by name)", [
            P("Reward per tenant", "Mean judged reward of each tenant's last trained batch.",
              [("max by (tenant) (liveloop_tenant_reward)", "{{tenant}}")]),
            P("Adapter version per tenant", "The version each tenant's adapter is at.",
              [("max by (tenant) (liveloop_tenant_version)", "{{tenant}}")]),
            P("Refusals and rollbacks per tenant", "Versions of each tenant's adapter the gate "
              "refused, and rollbacks by the served-quality watch, in the time range.",
              [("sum by (tenant) (increase(liveloop_tenant_refusals_total[$__range]))",
                "{{tenant}} refused"),
               ("sum by (tenant) (increase(liveloop_tenant_rollbacks_total[$__range]))",
                "{{tenant}} rolled back")], kind="bargauge"),
        ]),
    ],
)

WEIGHTS = DashboardSpec(
    "liveloop-weights", "weights", "LiveLoop / Weights",
    "From checkpoint to serving: versions per replica, swap pauses, refused checkpoints, and "
    "how long a new version takes to reach traffic.",
    [
        RowSpec("Versions", [
            P("Serving version per replica", "Each replica's policy version, and the trainer's "
              "newest.", [("max by (instance) (liveloop_policy_version)", "{{instance}}"),
                          ("max(liveloop_trainer_version)", "trainer")], width=12),
            P("Versions behind the trainer", "Trainer version minus serving version, per replica.",
              [("scalar(max(liveloop_trainer_version)) - max by (instance) "
                "(liveloop_policy_version)", "{{instance}}")],
              width=12, thresholds=[(2, "orange"), (5, "red")]),
        ]),
        RowSpec("Swaps", [
            P("Swap pause", "Time a replica's decode loop paused to apply new weights.",
              quantiles("liveloop_weight_swap_pause_seconds", qs=(0.5, 0.99)), unit="s"),
            P("Checkpoint load time", "Reading and validating a checkpoint, off the serving path.",
              quantiles("liveloop_weight_load_seconds", qs=(0.5, 0.99)), unit="s"),
            P("Checkpoint to serving", "Trainer announcing a version to a replica serving it.",
              quantiles("liveloop_weight_checkpoint_to_serving_seconds", qs=(0.5, 0.99)),
              unit="s"),
            P("Refused checkpoints", "Checkpoints a replica refused in the time range (missing "
              "files, wrong shapes, NaNs); it kept serving the old version.",
              [(REFUSED, "{{instance}}")], kind="stat", thresholds=[(1, "red")]),
            P("Swaps by outcome", "Swaps per minute: ok or refused.",
              [rate_by("liveloop_weight_swaps_total", "outcome", " * 60")]),
            P("Checkpoint publish time", "The trainer's checkpoint write and announcement.",
              [("max(liveloop_trainer_publish_seconds)", "publish")], unit="s"),
        ]),
    ],
)
# fmt: on

DASHBOARDS = (SERVING, PIPELINE, LEARNING, WEIGHTS)

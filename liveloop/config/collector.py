"""Settings of the collecting loop (`liveloop collect`)."""

from typing import Literal, Self

from pydantic import Field, model_validator

from liveloop.config.base import Section
from liveloop.config.consumer import ConsumerSettings, consumer_defaults

BaselineScope = Literal["judge", "task"]
"""What a lone turn's reward baseline is kept per (`CollectorConfig.baseline_scope`)."""


class CollectorConfig(Section):
    """Advantage estimation and batch packing (the staleness bound is `max_staleness`, shared)."""

    token_budget: int = Field(
        4096, ge=64, description="Most tokens (prompt + completion) packed into one batch."
    )
    min_turns: int = Field(
        16,
        ge=1,
        description=(
            "A batch ships once it holds this many turns (or its tokens reach "
            "`min_fill` x `token_budget`)."
        ),
    )
    min_fill: float = Field(
        0.5,
        gt=0,
        le=1,
        description="A batch holding at least this fraction of `token_budget` tokens ships too.",
    )
    max_wait_s: float = Field(
        20.0, gt=0, description="Flush a non-empty batch after this many seconds anyway."
    )
    max_queued_batches: int | None = Field(
        1,
        ge=1,
        description=(
            "Most published batches waiting for the trainer. While this many wait, ready "
            "turns are held (those that grow stale are dropped) and the next batch is packed "
            "from the freshest of them once the trainer takes one, so a trainer slower than "
            "the traffic trains on full, fresh batches instead of working through a stale "
            "backlog. Unset: no bound (every ready batch is published at once)."
        ),
    )
    max_held_turns: int = Field(
        8192,
        ge=1,
        description=(
            "Most turns held in memory; beyond it no new scored turns are read until some "
            "are published or dropped (the rest wait in Redis)."
        ),
    )
    group_wait_s: float = Field(
        1.0,
        ge=0,
        description=(
            "How long a prompt's group stays open for more samples (same group key, n > 1) "
            "before its advantages are computed."
        ),
    )
    call_credit: float = Field(
        0.5,
        ge=0,
        le=1,
        description=(
            "How much of a tool call's score comes from the answer it led to: a turn whose "
            "reply called tools waits for the judgment of the turn that answered with their "
            "results, and scores (1 - call_credit) x its own score (the tool result's) + "
            "call_credit x the answer's (a chain of calls takes the final answer's). 0: a call "
            "is judged by its tool result alone and nothing waits. Lone samples only (n = 1)."
        ),
    )
    call_credit_wait_s: float = Field(
        300.0,
        gt=0,
        description=(
            "Longest a tool call waits for its answer's judgment; then it goes on with its own "
            "score. Must exceed the judge's `prm.next_state_timeout_s`; leave room for the "
            "time an agent takes to answer after a tool result and its user to reply."
        ),
    )
    baseline_decay: float = Field(
        0.9, gt=0, lt=1, description="Decay of the running reward baselines (EMA)."
    )
    baseline_scope: BaselineScope = Field(
        "judge",
        description=(
            "What a lone turn's score is measured against. 'judge': the running mean of its "
            "judge's scores. 'task': the running mean of the scores of turns with the same "
            "judge, system prompt and offered tools (the judge's until that task has "
            "`baseline_min_task_turns` scores), so a task that always fails or always "
            "succeeds does not push its replies down or up against the others; for "
            "deployments where agents of very different success share a judge."
        ),
    )
    baseline_per_judge: bool = Field(
        True,
        description=(
            "One running baseline per judge (true), or one that all judges share (false): for "
            "judges that score the same outcome on one scale, such as explicit feedback on a "
            "session's last reply and the rules judge's reading of the user's replies before "
            "it. Kept per judge, the same reply is measured against different means depending "
            "on where in a session it fell."
        ),
    )
    baseline_min_task_turns: int = Field(
        4, ge=1, description="Scores a task needs before its own baseline is used."
    )
    baseline_max_tasks: int = Field(
        256,
        ge=1,
        description="Most task baselines kept (and stored); the least recently scored go first.",
    )
    inline_max_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description=(
            "Batches larger than this (as JSON) go to a file under `<data-dir>/batches/` and "
            "the stream entry carries its path relative to the data dir."
        ),
    )
    version_poll_s: float = Field(
        0.2,
        gt=0,
        description="How often the trainer's current version is re-read from liveloop:weights.",
    )
    consumer: ConsumerSettings = Field(
        default_factory=lambda: consumer_defaults(claim_idle_ms=120_000, read_count=256),
        description="The collector in consumer group `collector`; keep claim_idle_ms well "
        "above (max_wait_s + group_wait_s), since turns stay pending until batched.",
    )

    @model_validator(mode="after")
    def _claim_after_wait(self) -> Self:
        """Turns stay pending while they wait for a batch: others must not reclaim them."""
        if self.consumer.claim_idle_ms < 2000 * (self.max_wait_s + self.group_wait_s):
            raise ValueError(
                "consumer.claim_idle_ms must be at least twice (max_wait_s + group_wait_s), in ms"
            )
        return self

"""Settings of the judging loop (`liveloop judge`)."""

from pydantic import Field

from liveloop.config.base import Section


class LLMJudgeConfig(Section):
    """LLM-as-judge over any OpenAI-compatible endpoint."""

    base_url: str | None = Field(
        None, description="OpenAI-compatible base URL (default: this LiveLoop server's /v1)."
    )
    model: str | None = Field(None, description="Model name to ask (default: the served model).")
    api_key: str = Field("none", description="API key for the judge endpoint.")
    votes: int = Field(3, ge=1, le=15, description="Votes per turn; majority wins, ties give 0.")
    timeout_s: float = Field(30.0, gt=0, description="Timeout of one judge request.")
    concurrency: int = Field(8, ge=1, description="Most judge requests in flight.")
    max_tokens: int = Field(64, ge=1, description="Completion budget of one vote.")


class JudgeConfig(Section):
    """Which judges score turns, and how the judging loop consumes its streams."""

    judges: dict[str, float] = Field(
        default_factory=lambda: {"feedback": 1.0, "rules": 1.0},
        description="Judge name -> weight; names come from the 'liveloop.judges' entry points.",
    )
    next_state_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Seconds to wait for a turn's next state before judging without one.",
    )
    max_attempts: int = Field(
        5, ge=1, description="Failed attempts before an entry goes to the dead-letter stream."
    )
    claim_idle_ms: int = Field(
        30_000,
        ge=100,
        description="Pending entries idle this long are reclaimed from dead consumers.",
    )
    read_count: int = Field(256, ge=1, description="Entries read per XREADGROUP call.")
    consumer_name: str | None = Field(
        None, description="Consumer name in the group (default: host-pid)."
    )
    llm: LLMJudgeConfig = Field(default_factory=LLMJudgeConfig)

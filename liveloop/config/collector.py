"""Settings of the collecting loop (`liveloop collect`)."""

from pydantic import Field

from liveloop.config.base import Section


class CollectorConfig(Section):
    """Staleness bound, advantage estimation and batch packing."""

    max_staleness: int = Field(
        4, ge=0, description="Drop turns whose oldest token is more versions behind; 0 = on-policy."
    )
    token_budget: int = Field(
        4096, ge=64, description="Most tokens (prompt + completion) packed into one batch."
    )
    min_turns: int = Field(16, ge=1, description="Fewest turns in a batch before it is flushed.")
    max_wait_s: float = Field(
        20.0, gt=0, description="Flush a non-empty batch after this many seconds anyway."
    )
    baseline_decay: float = Field(
        0.9, gt=0, lt=1, description="Decay of the running reward baseline per judge."
    )
    inline_max_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Batches larger than this go to a file, by reference."
    )

"""Settings of the served-quality watch, which rolls back a version whose served turns went bad."""

from pydantic import Field

from liveloop.config.base import Section


class WatchSettings(Section):
    """After a version goes live, its judged served turns are compared with earlier versions'.

    The promotion gate judges a handful of probe replies before a version is served; the
    watch judges what it actually served. When a version's mean served reward falls below
    that of the last `lookback` good versions' turns together by more than `reward_margin`,
    and the gap is larger than `z` standard errors of the two means (so a few unlucky turns
    do not trigger it), the trainer goes back to the newest good version's weights and
    publishes them as a new version; the bad version and its successors are marked
    `rolled_back`.
    """

    enabled: bool = Field(True, description="Watch each served version and roll back bad ones.")
    min_turns: int = Field(
        20,
        ge=2,
        description="Judged served turns a version needs before it is compared (a version "
        "replaced before it had them is skipped once a later one has them).",
    )
    min_base_turns: int = Field(
        8,
        ge=2,
        description="Judged served turns that make version 0 (the base) the baseline although "
        "it has fewer than min_turns, once the versions after it have min_turns: a tenant's base "
        "serves that tenant only until its first adapter, often fewer than min_turns turns. "
        "The z test weighs how few they are. With fewer, the base is skipped and the first "
        "version judged is taken as good with nothing to compare it with.",
    )
    reward_margin: float = Field(
        0.3,
        ge=0,
        le=2,
        description="Roll back only when the mean served reward is below the good versions' "
        "by more than this.",
    )
    z: float = Field(
        2.33,
        ge=0,
        description="... and by more than this many standard errors of the difference of the "
        "two means (2.33: about a 1% chance that two equal versions trigger it).",
    )
    lookback: int = Field(
        3,
        ge=1,
        description="Good versions whose turns, together, a version is compared with. Their "
        "checkpoints, and those of the next this many versions to be checked, are kept on "
        "disk beyond trainer.keep_checkpoints, so that the newest good one can be served again.",
    )
    max_nll_ratio: float | None = Field(
        1.4,
        gt=1,
        description="Also roll back a version whose served replies' reference NLL per token "
        "exceeds this multiple of version 0's (models with language, when the trainer keeps "
        "the reference); a version is then compared once its served tokens are measured, or "
        "on its turns alone when a later version is ready first; unset = no bound.",
    )
    min_ref_tokens: int = Field(
        600,
        ge=1,
        description="Served tokens the reference NLL of a version must be over before the "
        "NLL bound reads it (a few hundred tokens say little), unless it is over min_turns "
        "served replies (short replies may never add up to the tokens).",
    )
    check_interval_s: float = Field(
        5.0, gt=0, description="How often the trainer reads the served counters."
    )

"""Settings of stream retention (`retention`): which stream entries are archived and trimmed.

Without retention the streams grow for ever in Redis memory. An entry is trimmed only once
every consumer group of its stream has acknowledged it, once it is older than its stream's
window and once it is not among the newest `keep_newest` entries of its stream; it is
written to the archive first (unless `archive` is off). The collecting loop runs it.
"""

from pathlib import Path

from pydantic import Field

from liveloop.config.base import Section

DAY_S = 24 * 3600.0


class StreamWindows(Section):
    """How long, in seconds, an entry stays in each stream after it was written (at least:
    an entry a consumer group has not acknowledged yet stays however old it is)."""

    turns: float = Field(DAY_S, ge=0, description="Window of liveloop:turns.")
    scored: float = Field(DAY_S, ge=0, description="Window of liveloop:scored.")
    batches: float = Field(DAY_S, ge=0, description="Window of liveloop:batches.")
    feedback: float = Field(DAY_S, ge=0, description="Window of liveloop:feedback.")
    weights: float = Field(
        DAY_S,
        ge=0,
        description="Window of liveloop:weights (no consumer group: servers read it with "
        "XREAD; `keep_newest.weights` announcements stay whatever their age).",
    )
    dead_letters: float = Field(
        7 * DAY_S,
        ge=0,
        description="Window of every dead-letter twin (liveloop:<stream>:dlq), kept longer "
        "than the streams so an operator has time to look at failures.",
    )


class KeepNewest(Section):
    """How many of the newest entries of each stream stay whatever their age: what the
    readers that look at the newest entries of a stream need even after a quiet day."""

    turns: int = Field(
        2000,
        ge=0,
        description="Newest entries of liveloop:turns kept; the gate's 'served' probe source "
        "draws from the newest `trainer.gate.served_scan` of them: keep at least as many.",
    )
    scored: int = Field(
        200,
        ge=0,
        description="Newest entries of liveloop:scored kept (the live view's recent reward "
        "reads the newest 50).",
    )
    batches: int = Field(0, ge=0, description="Newest entries of liveloop:batches kept.")
    feedback: int = Field(0, ge=0, description="Newest entries of liveloop:feedback kept.")
    weights: int = Field(
        64,
        ge=1,
        description="Newest announcements of liveloop:weights kept (servers and the collector "
        "look back over the newest 16 for the newest servable version).",
    )
    dead_letters: int = Field(0, ge=0, description="Newest entries of each dead-letter twin kept.")


class RetentionSettings(Section):
    """Archiving and trimming of the streams, run by the collecting loop."""

    enabled: bool = Field(
        True,
        description="Trim the streams (archiving first); off: the streams grow without bound.",
    )
    interval_s: float = Field(
        60.0, gt=0, description="Seconds between two retention passes over every stream."
    )
    windows: StreamWindows = Field(
        default_factory=StreamWindows, description="Per stream: how long entries stay, seconds."
    )
    keep_newest: KeepNewest = Field(
        default_factory=KeepNewest,
        description="Per stream: how many of the newest entries stay whatever their age.",
    )
    archive: bool = Field(
        True,
        description="Write trimmed entries to `archive_dir` before trimming them; off: "
        "trimmed entries are gone (no replay of them).",
    )
    archive_dir: Path | None = Field(
        None,
        description="Directory of the archive (gzip JSON lines, one directory per stream, one "
        "per UTC day); unset: `<data-dir>/archive`. Several collectors must share it.",
    )
    chunk_entries: int = Field(
        10_000,
        ge=1,
        description="Entries archived (into one set of files) and trimmed at a time; a pass "
        "goes on chunk by chunk until nothing more may go.",
    )
    lock_ttl_s: float = Field(
        300.0,
        gt=0,
        description="Lifetime of the lock that keeps two collectors from trimming at once "
        "(renewed before each chunk); a collector that died holding it frees it after this.",
    )

    def archive_path(self, data_dir: Path) -> Path:
        """The archive directory: `archive_dir`, or `archive` under the data dir."""
        return self.archive_dir if self.archive_dir is not None else data_dir / "archive"

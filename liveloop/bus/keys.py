"""Every Redis/Valkey key and stream LiveLoop uses, named in one place.

All keys start with `liveloop:`. Streams have a short name (`turns`) and a full key
(`liveloop:turns`); each has a dead-letter twin (`liveloop:turns:dlq`). Lua scripts never
build key names themselves: callers pass the names made here, so a key's layout is
written down once. Turn keys (`session:turn:sample`) and group keys (`session:turn`) come
from `liveloop.contracts`.
"""

from __future__ import annotations

PREFIX = "liveloop:"

# Streams, by short name -----------------------------------------------------------------
TURNS = "turns"
"""Served turns, written by the server."""
SCORED = "scored"
"""Judged turns, written by the judging loop."""
BATCHES = "batches"
"""Training batches, written by the collector."""
WEIGHTS = "weights"
"""Weights announcements, written by the trainer (see `liveloop.weights`)."""
FEEDBACK = "feedback"
"""Explicit feedback, written by `POST /v1/feedback`."""
STREAMS = (TURNS, SCORED, BATCHES, WEIGHTS, FEEDBACK)
"""The public streams (a replay must never write into one of them)."""
DEAD_LETTERED = (TURNS, SCORED, BATCHES, FEEDBACK)
"""Streams whose consumers dead-letter entries that failed too often."""

# Consumer groups ------------------------------------------------------------------------
PRM_GROUP = "prm"
COLLECTOR_GROUP = "collector"
TRAINER_GROUP = "trainer"

READERS: dict[str, tuple[str, ...]] = {
    TURNS: (PRM_GROUP,),
    FEEDBACK: (PRM_GROUP,),
    SCORED: (COLLECTOR_GROUP,),
    BATCHES: (TRAINER_GROUP,),
    WEIGHTS: (),
}
"""The consumer groups that read each public stream (none for `weights`: servers XREAD it);
retention trims nothing of a stream before each of its groups exists and has acknowledged."""


def stream_key(name: str) -> str:
    """Full key of a stream name (`turns` -> `liveloop:turns`); full keys pass through."""
    return name if name.startswith(PREFIX) else PREFIX + name


def dlq_key(name: str) -> str:
    """Dead-letter twin of a stream."""
    return stream_key(name) + ":dlq"


def dedupe_marker(stream: str, dedupe_key: str) -> str:
    """The marker that makes a write to `stream` exactly-once for `dedupe_key`."""
    return f"{stream_key(stream)}:seen:{dedupe_key}"


def attempts_key(stream: str, group: str) -> str:
    """Hash: entry id -> failed attempts, per consumer group."""
    return f"{stream_key(stream)}:attempts:{group}"


def retry_key(stream: str, group: str) -> str:
    """Hash: entry id -> time before which a failed entry is not retried."""
    return f"{stream_key(stream)}:retry:{group}"


def batch_members() -> str:
    """Sorted set of the turn keys already part of a published batch (scored by time)."""
    return stream_key(BATCHES) + ":members"


# Retention (collecting loop, see `liveloop.bus.retention`) --------------------------------
RETENTION_LOCK = PREFIX + "retention:lock"
"""Held (SET NX PX) by the one collector that archives and trims the streams at a time."""


# Collecting loop ------------------------------------------------------------------------
COLLECTOR_BASELINES = PREFIX + "collector:baselines"
"""Hash of the running reward baselines per judge, restored when a collector starts."""


# Per-version quality (judging loop and trainer, see `liveloop.quality`) -------------------
QUALITY_VERSIONS = PREFIX + "quality:versions"
"""Sorted set of the versions that have quality counters."""


def quality_counters(version: int) -> str:
    """Hash of the quality counters of one version."""
    return f"{PREFIX}quality:v{version}"


def quality_bigrams(version: int) -> str:
    """HyperLogLog of the distinct reply bigrams of one version."""
    return quality_counters(version) + ":bigrams"


def tenant_base_quality(tenant: str) -> str:
    """Hash of the quality counters of version 0 (the base) on one tenant's turns alone."""
    return f"{PREFIX}quality:tenant:{tenant}:v0"


def tenant_base_bigrams(tenant: str) -> str:
    """HyperLogLog of the distinct reply bigrams of version 0 on one tenant's turns."""
    return tenant_base_quality(tenant) + ":bigrams"


# Sessions (serving loop) ----------------------------------------------------------------
SESSION_PREFIX = PREFIX + "session:"
PREFIX_INDEX = PREFIX + "prefix:"


def session_key(session_id: str) -> str:
    """Hash of one session: owning tenant, number of turns, timestamps."""
    return SESSION_PREFIX + session_id


def prefix_index_key(tenant: str, digest: str) -> str:
    """A served sample, found by the chain hash of its messages and reply."""
    return f"{PREFIX_INDEX}{tenant}:{digest}"


# Next-state pairing (judging loop) --------------------------------------------------------
PRM_PREFIX = PREFIX + "prm:"
PRM_READY = PRM_PREFIX + "ready"
"""Internal stream of turns whose next state is known (consumer group `prm`)."""
PRM_DEADLINES = PRM_PREFIX + "deadlines"
"""Sorted set: waiting turn key -> next-state deadline."""


def waiting_key(turn_key: str) -> str:
    """The raw record of a turn waiting for its next state."""
    return f"{PRM_PREFIX}w:{turn_key}"


def waiting_group(group_key: str) -> str:
    """Set of the waiting samples of one (session, turn)."""
    return f"{PRM_PREFIX}g:{group_key}"


def early_feedback_key(group_key: str) -> str:
    """Feedback that arrived before its turn."""
    return f"{PRM_PREFIX}fb:{group_key}"


def arrival_key(group_key: str) -> str:
    """The request messages of a turn that arrived before its predecessor."""
    return f"{PRM_PREFIX}a:{group_key}"


def side_marker(group_key: str) -> str:
    """Marks a turn index of a session as a side turn (nobody's next state)."""
    return f"{PRM_PREFIX}side:{group_key}"

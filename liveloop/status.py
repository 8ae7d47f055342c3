"""What the loops are doing, read from the streams: the live terminal view of `up` and `demo`.

Everything shown is derived from Redis (stream lengths, the newest weights announcement,
recent scored turns), so it needs no cooperation from the loop processes and also works
against a deployment. It makes "why nothing is training yet" visible: side, unjudged and
dead-lettered turns are counted next to judged and batched ones.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import redis

from liveloop import bus
from liveloop.contracts import ScoredTurn
from liveloop.supervisor import Supervisor
from liveloop.weights import latest_announcement_sync


@dataclass
class Snapshot:
    """Counts and rates at one moment."""

    at: float
    turns: int = 0
    scored: int = 0
    batches: int = 0
    dead_letters: int = 0
    policy_version: int = 0
    reward_avg: float | None = None
    staleness_avg: float | None = None
    turns_per_s: float = 0.0
    recent_scores: list[float] = field(default_factory=list)


class StatsReader:
    """Reads a Snapshot from Redis; keeps the previous one to compute rates."""

    def __init__(self, redis_url: str, window: int = 50) -> None:
        self.client = bus.redis_client_sync(redis_url, timeout_s=2)
        self.window = window
        self._last: Snapshot | None = None

    def snapshot(self) -> Snapshot:
        """Current counts; on a Redis error, the last snapshot (or zeros)."""
        try:
            snap = self._read()
        except (redis.RedisError, OSError):
            return self._last or Snapshot(at=time.time())
        if self._last is not None and snap.at > self._last.at:
            snap.turns_per_s = (snap.turns - self._last.turns) / (snap.at - self._last.at)
        self._last = snap
        return snap

    def _read(self) -> Snapshot:
        pipe = self.client.pipeline(transaction=False)
        for name in (bus.TURNS, bus.SCORED, bus.BATCHES):
            pipe.xlen(bus.stream_key(name))
        for name in bus.keys.DEAD_LETTERED:
            pipe.xlen(bus.dlq_key(name))
        pipe.xrevrange(bus.stream_key(bus.SCORED), count=self.window)
        res: list[Any] = pipe.execute()
        snap = Snapshot(at=time.time(), turns=res[0], scored=res[1], batches=res[2])
        snap.dead_letters = sum(res[3:-1])
        latest = latest_announcement_sync(self.client)  # never a version the gate refused
        snap.policy_version = latest.version if latest is not None else 0
        scores, stale = [], []
        for turn in bus.decode_entries(res[-1], ScoredTurn):
            scores.append(turn.score)
            if turn.versions:
                stale.append(snap.policy_version - turn.min_version)
        if scores:
            snap.recent_scores = scores
            snap.reward_avg = sum(scores) / len(scores)
            snap.staleness_avg = sum(stale) / len(stale) if stale else None
        return snap

    def close(self) -> None:
        """Close the Redis connection."""
        self.client.close()


def scrape_counts(url: str, wanted: dict[str, tuple[str, dict[str, str]]]) -> dict[str, float]:
    """Selected samples from a Prometheus /metrics page: label -> value (missing ones absent)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url, timeout=1.0).text
    except httpx.HTTPError:
        return {}
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for label, (name, labels) in wanted.items():
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    found[label] = found.get(label, 0.0) + sample.value
    return found


# Why nothing is training yet: turns that never become training data, by reason.
NOT_TRAINED = {
    "judge": {
        "side turns (never trained)": ("liveloop_prm_turns_total", {"outcome": "side"}),
        "unjudged (no next state)": ("liveloop_prm_turns_total", {"outcome": "unscored"}),
    },
    "collect": {
        "dropped as stale": ("liveloop_collector_dropped_turns_total", {"reason": "stale"}),
    },
}


class LiveView:
    """A rich live table of the loops; prints nothing when quiet."""

    def __init__(
        self, supervisor: Supervisor, quiet: bool = False, title: str = "LiveLoop"
    ) -> None:
        self.supervisor = supervisor
        self.quiet = quiet
        self.title = title
        self.events: deque[str] = deque(maxlen=5)
        self.extra: dict[str, str] = {}
        self.reader: StatsReader | None = None
        self._live: Any = None

    def __enter__(self) -> LiveView:
        self.reader = StatsReader(self.supervisor.redis_url)
        if not self.quiet:
            from rich.live import Live

            self._live = Live(self._render(), refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._live is not None:
            self._live.__exit__(exc_type, exc, tb)
        if self.reader is not None:
            self.reader.close()

    def event(self, line: str) -> None:
        """Show an event (a crash, a restart) under the table."""
        self.events.append(time.strftime("%H:%M:%S ") + line)

    def refresh(self) -> None:
        """Redraw with a fresh snapshot."""
        if self._live is not None:
            self._live.update(self._render())

    def _not_trained_rows(self) -> list[tuple[str, str]]:
        rows = []
        for loop, wanted in NOT_TRAINED.items():
            url = self.supervisor.metrics_url(loop)
            counts = scrape_counts(url, wanted) if url else {}
            rows += [(label, f"{counts.get(label, 0):.0f}") for label in wanted]
        return rows

    def _render(self) -> Any:
        from rich.table import Table

        snap = self.reader.snapshot() if self.reader else Snapshot(at=time.time())
        table = Table(title=self.title, show_header=False, expand=False)
        reward = "-" if snap.reward_avg is None else f"{snap.reward_avg:+.3f}"
        stale = "-" if snap.staleness_avg is None else f"{snap.staleness_avg:.1f}"
        rows = [
            ("serving", f"{self.supervisor.base_url}/v1"),
            ("turns recorded", f"{snap.turns}  ({snap.turns_per_s:.1f}/s)"),
            ("turns judged", str(snap.scored)),
            ("batches", str(snap.batches)),
            ("policy version", str(snap.policy_version)),
            (f"reward (last {len(snap.recent_scores)})", reward),
            ("staleness (versions)", stale),
            ("dead letters", str(snap.dead_letters)),
        ]
        rows += list(self.extra.items())
        rows += self._not_trained_rows()
        for loop in self.supervisor.loops:
            state = "up" if loop.alive else f"down (exit {loop.last_exit})"
            rows.append((f"loop {loop.name}", f"{state}, restarts {loop.restarts}"))
        for key, value in rows:
            table.add_row(key, value)
        for line in self.events:
            table.add_row("event", line)
        return table

"""Replay: re-score historical turns with other judges into a separate stream.

Reads `liveloop:turns` with XRANGE from a given id (given the retention archive, the turns
archived and trimmed from the stream first, then the stream's, each id once), pairs each
main turn with the next main turn of its session found in that history (and with explicit
feedback from `liveloop:feedback` and its archive), judges each turn with the given judges
and writes ScoredTurns to the target stream, exactly once per turn key, so re-running a
replay adds nothing twice. Turns without a successor are judged with no next state. The
live consumer groups are untouched.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aredis
from pydantic import ValidationError

from liveloop import bus
from liveloop.bus.archive import Archive
from liveloop.contracts import Feedback, TurnRecord
from liveloop.prm.judges.base import JudgeError, JudgeRequest, NextState
from liveloop.prm.nextstate import new_messages
from liveloop.prm.panel import JudgePanel
from liveloop.prm.scorer import make_scored, scored_index

log = logging.getLogger(__name__)

Group = tuple[str, int]


@dataclass
class ReplayStats:
    """Counts of one replay run."""

    read: int = 0
    from_archive: int = 0
    scored: int = 0
    duplicate: int = 0
    unscored: int = 0
    side: int = 0
    failed: int = 0
    malformed: int = 0
    last_id: str | None = None
    errors: list[str] = field(default_factory=list)


class Replayer:
    """Streams historical turns (archived ones first, given an archive) through a judge panel
    into `to_stream`."""

    def __init__(
        self,
        client: aredis.Redis,
        panel: JudgePanel,
        to_stream: str,
        *,
        batch: int = 512,
        attempts: int = 3,
        archive: Archive | None = None,
    ) -> None:
        self.client = client
        self.archive = archive
        self.panel = panel
        self.to_stream = bus.stream_key(to_stream)
        self.batch = batch
        self.attempts = attempts
        self.stats = ReplayStats()
        self._open: dict[Group, list[TurnRecord]] = {}
        self._feedback: dict[Group, Feedback] = {}

    async def run(self, from_id: str = "-") -> ReplayStats:
        """Replay every turn from `from_id` (inclusive) to the end of the stream."""
        await self._load_feedback()
        async for entries in self._turn_pages(from_id):
            ready: list[tuple[TurnRecord, NextState]] = []
            for entry_id, fields in entries:
                ready += self._take(str(entry_id), fields)
            await self._score(ready)
            self.stats.last_id = str(entries[-1][0])
        rest = [t for turns in self._open.values() for t in turns]
        self._open.clear()
        await self._score([(t, NextState(feedback=self._feedback.get(_group(t)))) for t in rest])
        return self.stats

    async def _turn_pages(self, from_id: str) -> AsyncIterator[list[Any]]:
        """Pages of (id, fields) from `from_id` on: the archive's, then Redis' after them."""
        start = from_id
        if self.archive is not None:
            for page in self.archive.pages(bus.stream_key(bus.TURNS), from_id, self.batch):
                self.stats.from_archive += len(page)
                yield page
                start = "(" + page[-1][0]
        while True:
            entries: Any = await self.client.xrange(
                bus.stream_key(bus.TURNS), min=start, count=self.batch
            )
            if not entries:
                return
            yield entries
            start = "(" + str(entries[-1][0])

    async def _load_feedback(self) -> None:
        history: list[Any] = []
        if self.archive is not None:
            history += self.archive.entries(bus.stream_key(bus.FEEDBACK))
        live: Any = await self.client.xrange(bus.stream_key(bus.FEEDBACK))
        history += live
        for _id, fields in history:
            try:
                fb = bus.decode(fields, Feedback)
            except (ValidationError, ValueError):
                continue
            self._feedback.setdefault((fb.session_id, fb.turn_index), fb)

    def _take(self, entry_id: str, fields: dict[str, str]) -> list[tuple[TurnRecord, NextState]]:
        self.stats.read += 1
        try:
            turn = bus.decode(fields, TurnRecord)
        except (ValidationError, ValueError):
            self.stats.malformed += 1
            log.warning("replay: turn entry %s is malformed, skipped", entry_id)
            return []
        if turn.turn_type != "main":
            self.stats.side += 1
            return []
        previous = self._open.pop((turn.session_id, turn.turn_index - 1), [])
        self._open.setdefault(_group(turn), []).append(turn)
        return [
            (
                prev,
                NextState(
                    messages=new_messages(prev.messages, turn.messages),
                    feedback=self._feedback.get(_group(prev)),
                ),
            )
            for prev in previous
        ]

    async def _score(self, items: list[tuple[TurnRecord, NextState]]) -> None:
        for chunk_start in range(0, len(items), 64):
            chunk = items[chunk_start : chunk_start + 64]
            await asyncio.gather(*(self._score_one(turn, state) for turn, state in chunk))

    async def _score_one(self, turn: TurnRecord, state: NextState) -> None:
        for attempt in range(1, self.attempts + 1):
            try:
                verdict = await self.panel.judge(JudgeRequest.for_turn(turn, state))
                break
            except JudgeError as exc:
                if attempt == self.attempts:
                    self.stats.failed += 1
                    self.stats.errors.append(f"{turn.key}: {exc}")
                    return
                await asyncio.sleep(0.2 * 2**attempt)
        if verdict is None:
            self.stats.unscored += 1
            return
        scored = make_scored(turn, verdict, state.signal)
        index = scored_index(turn, verdict, state.signal)
        if await bus.publish(self.client, self.to_stream, scored, dedupe_key=turn.key, **index):
            self.stats.scored += 1
        else:
            self.stats.duplicate += 1


def _group(turn: TurnRecord) -> Group:
    return (turn.session_id, turn.turn_index)

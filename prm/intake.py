"""Intake: move turns and explicit feedback from their streams into the pairing state.

A turns-stream entry is acknowledged once its pairing state is stored in Redis (the turn is
then owned by the pairing state and the ready stream, not by the turns stream). Side turns
are never stored (they can never become trainable): they only leave a marker so that the
main turns around them pair with each other, and are acknowledged and counted. A record that
does not parse goes straight to the dead-letter stream; a Redis error on one entry leaves
it pending for a retry.
"""

from __future__ import annotations

import logging
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from liveloop.bus import Entry, StreamConsumer
from liveloop.contracts import Feedback, TurnRecord
from liveloop.prm.metrics import PrmMetrics
from liveloop.prm.pairing import PairingStore, PendingTurn

log = logging.getLogger(__name__)

RecordT = TypeVar("RecordT", bound=BaseModel)


class _Intake:
    """What both intakes share: the consumer, the pairing store, and parsing a batch."""

    def __init__(self, consumer: StreamConsumer, store: PairingStore, metrics: PrmMetrics) -> None:
        self.consumer = consumer
        self.store = store
        self.metrics = metrics

    async def _parse(
        self, entries: list[Entry], model: type[RecordT], what: str
    ) -> list[tuple[Entry, RecordT]]:
        """Each entry as `model`; one that does not parse goes to the dead-letter stream."""
        parsed: list[tuple[Entry, RecordT]] = []
        for entry in entries:
            try:
                parsed.append((entry, entry.parse(model)))
            except (ValidationError, ValueError) as exc:
                await self.consumer.dead_letter(entry, f"malformed {what}: {exc}")
                self.metrics.dead_letters.labels(self.consumer.dead_letter_stream).inc()
        return parsed


class TurnIntake(_Intake):
    """Reads `liveloop:turns` in group `prm` and stores each main turn for pairing."""

    async def step(self, block_ms: int = 500) -> int:
        """Process one batch; returns how many entries were read."""
        entries = await self.consumer.read(block_ms)
        if not entries:
            return 0
        done: list[str] = []
        pending: list[tuple[Entry, PendingTurn]] = []
        sides: list[tuple[Entry, TurnRecord]] = []
        for entry, turn in await self._parse(entries, TurnRecord, "turn record"):
            if turn.turn_type != "main":
                sides.append((entry, turn))
                continue
            pending.append((entry, PendingTurn.from_record(turn, entry.fields["data"])))
        # Side markers first: a main turn of the same batch then steps over them at once.
        marked = await self.store.add_side_turns([(t.session_id, t.turn_index) for _, t in sides])
        for (entry, _), result in zip(sides, marked, strict=True):
            if isinstance(result, Exception):
                await self.consumer.fail(entry, f"storing a side-turn marker failed: {result}")
                continue
            self.metrics.turns.labels("side").inc()
            done.append(entry.id)
        results = await self.store.add_turns([p for _, p in pending])
        for (entry, _), result in zip(pending, results, strict=True):
            if isinstance(result, Exception):
                await self.consumer.fail(entry, f"storing pairing state failed: {result}")
                continue
            if result[0] == "duplicate":
                self.metrics.turns.labels("duplicate").inc()
            done.append(entry.id)
        await self.consumer.ack(*done)
        return len(entries)


class FeedbackIntake(_Intake):
    """Reads `liveloop:feedback` in group `prm` and pairs feedback with waiting turns."""

    async def step(self, block_ms: int = 500) -> int:
        """Process one batch; returns how many entries were read."""
        entries = await self.consumer.read(block_ms)
        if not entries:
            return 0
        parsed = await self._parse(entries, Feedback, "feedback")
        results = await self.store.add_feedback([(fb, e.fields["data"]) for e, fb in parsed])
        done: list[str] = []
        for (entry, _), result in zip(parsed, results, strict=True):
            if isinstance(result, Exception):
                await self.consumer.fail(entry, f"storing feedback failed: {result}")
                continue
            self.metrics.feedback.labels(str(result)).inc()
            done.append(entry.id)
        await self.consumer.ack(*done)
        return len(entries)

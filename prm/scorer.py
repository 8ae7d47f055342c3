"""The scorer: judges turns whose next state is known and writes them to `liveloop:scored`.

It consumes jobs from the internal ready stream (one job = the turn keys that share one next
state). For each turn it loads the waiting record, runs the judge panel and, in one
pipeline, commits the scored entries (exactly once per turn key) and acknowledges the job.
A job whose judge fails stays pending and is retried with backoff; after `max_attempts` its
turns go to `liveloop:turns:dlq` with the error. Other jobs keep flowing meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from liveloop.bus import Entry, OnceResult, StreamConsumer
from liveloop.contracts import Feedback, ScoredTurn, TurnRecord
from liveloop.prm.judges.base import JudgeError, JudgeRequest, NextState, TurnHead, message_text
from liveloop.prm.metrics import PrmMetrics
from liveloop.prm.nextstate import new_messages
from liveloop.prm.pairing import PairingStore
from liveloop.prm.panel import JudgePanel, Verdict
from liveloop.quality import QualityStore

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One ready-stream entry: turn keys and their shared next state."""

    entry: Entry
    keys: list[str]
    next_messages: list[dict[str, Any]] | None
    feedback: Feedback | None

    @classmethod
    def parse(cls, entry: Entry) -> Job:
        """Decode a ready-stream entry; raises ValueError if malformed."""
        keys = json.loads(entry.fields.get("keys") or "null")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError("job keys must be a list of turn keys")
        nxt = entry.fields.get("next")
        messages = json.loads(nxt) if nxt else None
        if messages is not None and not (
            isinstance(messages, list) and all(isinstance(m, dict) for m in messages)
        ):
            raise ValueError("a job's next state must be a list of messages")
        raw_fb = entry.fields.get("feedback")
        feedback = Feedback.model_validate_json(raw_fb) if raw_fb else None
        return cls(entry, keys, messages, feedback)


Outcome = list[tuple[JudgeRequest, TurnHead, str, Verdict | None]]


def make_scored(turn: TurnRecord, verdict: Verdict, signal: str) -> ScoredTurn:
    """The scored entry: the whole turn (token data included) plus the verdict."""
    data = turn.model_dump()
    data.update(
        score=verdict.score,
        judge=verdict.judge,
        signal=signal,
        step_scores=verdict.step_scores,
        hint=verdict.hint,
        votes=verdict.votes,
        directive_hint=verdict.directive_hint,
    )
    return ScoredTurn.model_validate(data)


def scored_index(
    head: TurnHead | TurnRecord, verdict: Verdict, signal: str, judged_by: str = ""
) -> dict[str, str | int]:
    """Small index fields of a scored entry, beside its `data` (`judged_by`: the consumer).

    `hinted` is 1 for a turn whose verdict carries a directive hint, else 0.
    """
    index: dict[str, str | int] = {
        "session_id": head.session_id,
        "turn_index": head.turn_index,
        "judge": verdict.judge,
        "signal": signal,
        "hinted": int(bool(verdict.directive_hint)),
    }
    if judged_by:
        index["judged_by"] = judged_by
    return index


VERDICT_KEYS = re.compile(
    "|".join(f'"{name}"' for name in ScoredTurn.model_fields if name not in TurnRecord.model_fields)
)


def scored_fields(
    request: JudgeRequest, head: TurnHead, raw: str, verdict: Verdict, judged_by: str = ""
) -> dict[str, str]:
    """Stream fields of the scored entry, built from the turn's raw JSON.

    The verdict's fields are appended to the recorded JSON object as it is (the record was
    validated at intake, the verdict by the panel), which saves parsing and re-serialising
    the token data. A record in which a verdict field name appears at all takes the slow,
    safe path through ScoredTurn.
    """
    signal = request.signal
    body = raw.rstrip()
    if not body.endswith("}") or VERDICT_KEYS.search(body):
        data = make_scored(request.turn, verdict, signal).model_dump_json()
    else:
        tail = json.dumps(
            {
                "score": verdict.score,
                "judge": verdict.judge,
                "signal": signal,
                "step_scores": verdict.step_scores,
                "hint": verdict.hint,
                "votes": verdict.votes,
                "directive_hint": verdict.directive_hint,
                "judged_at": time.time(),
            }
        )
        data = body[:-1] + "," + tail[1:]
    fields = {"data": data}
    index = scored_index(head, verdict, signal, judged_by)
    fields.update({k: str(v) for k, v in index.items()})
    return fields


class Scorer:
    """Consumes ready jobs, judges their turns and commits the scores."""

    def __init__(
        self,
        consumer: StreamConsumer,
        store: PairingStore,
        panel: JudgePanel,
        metrics: PrmMetrics,
    ) -> None:
        self.consumer = consumer
        self.store = store
        self.panel = panel
        self.metrics = metrics

    async def process(self, entries: list[Entry]) -> None:
        """Judge and commit one batch of jobs."""
        jobs: list[Job] = []
        for entry in entries:
            try:
                jobs.append(Job.parse(entry))
            except (ValueError, KeyError) as exc:
                await self.consumer.dead_letter(entry, f"malformed ready job: {exc}")
        raws = await self.store.load([k for job in jobs for k in job.keys])
        per_job: list[list[str | None]] = []
        offset = 0
        for job in jobs:
            per_job.append(raws[offset : offset + len(job.keys)])
            offset += len(job.keys)
        outcomes: list[Outcome | BaseException]
        if self.panel.inline:  # judges that never wait: no task per job
            outcomes = []
            for job, job_raws in zip(jobs, per_job, strict=True):
                try:
                    outcomes.append(await self._judge_job(job, job_raws))
                except Exception as exc:
                    outcomes.append(exc)
        else:
            outcomes = await asyncio.gather(
                *(self._judge_job(job, r) for job, r in zip(jobs, per_job, strict=True)),
                return_exceptions=True,
            )
        done = [(j, o) for j, o in zip(jobs, outcomes, strict=True) if isinstance(o, list)]
        await self._commit(done)
        for job, job_raws, outcome in zip(jobs, per_job, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                await self._failed(job, outcome, job_raws)

    async def _judge_job(self, job: Job, raws: list[str | None]) -> Outcome:
        outcome: Outcome = []
        for key, raw in zip(job.keys, raws, strict=True):
            if raw is None:
                self.metrics.turns.labels("missing").inc()
                log.info("turn %s has no pairing state left (already scored?)", key)
                continue
            head = TurnHead.model_validate_json(raw)
            messages = None
            if job.next_messages is not None:
                messages = new_messages(head.messages, job.next_messages)
            state = NextState(messages=messages, feedback=job.feedback)
            request = JudgeRequest(head.messages, head.response, state, raw=raw)
            outcome.append((request, head, raw, await self.panel.judge(request)))
        return outcome

    async def _commit(self, done: list[tuple[Job, Outcome]]) -> None:
        """One pipeline: scored entries (once per turn), state clean-up, job acks."""
        if not done:
            return
        # (position in the pipeline, signal, turn, score) of every scored entry
        commits: list[tuple[int, str, TurnHead, float]] = []
        finished: list[tuple[TurnHead, float | None]] = []  # for the per-version quality
        async with self.store.client.pipeline(transaction=False) as pipe:
            for _job, outcome in done:
                for request, head, raw, verdict in outcome:
                    if verdict is None:
                        self.store.queue_drop(pipe, head)
                        finished.append((head, None))
                        continue
                    commits.append((len(pipe.command_stack), request.signal, head, verdict.score))
                    fields = scored_fields(request, head, raw, verdict, self.consumer.consumer)
                    await self.store.queue_commit(pipe, head, fields)
            self.consumer.queue_ack(pipe, *(job.entry.id for job, _ in done))
            results = await pipe.execute()
        self.metrics.turns.labels("unscored").inc(len(finished))
        for position, signal, head, score in commits:
            if OnceResult.parse(results[position]).written:
                self.metrics.turns.labels("scored").inc()
                self.metrics.scored.labels(signal).inc()
                finished.append((head, score))
            else:
                self.metrics.turns.labels("duplicate").inc()
        await self._count_quality(finished)

    async def _count_quality(self, finished: list[tuple[TurnHead, float | None]]) -> None:
        """Per-version quality counters of the turns finished just now (after their commit)."""
        if not finished:
            return
        async with self.store.client.pipeline(transaction=False) as pipe:
            for head, score in finished:
                text = message_text(head.response)
                QualityStore.queue_turn(pipe, head.min_version, score, text, head.tenant)
            await pipe.execute()

    async def _failed(self, job: Job, error: BaseException, raws: list[str | None]) -> None:
        message = (
            str(error) if isinstance(error, JudgeError) else f"{type(error).__name__}: {error}"
        )
        dead = [
            {"data": raw, "turn_key": key}
            for key, raw in zip(job.keys, raws, strict=True)
            if raw is not None
        ]
        if await self.consumer.fail(job.entry, message, dead_letters=dead):
            self.metrics.dead_letters.labels(self.consumer.dead_letter_stream).inc(len(dead))
            self.metrics.turns.labels("dead_letter").inc(len(dead))
            await self._forget(raws)
            heads = [TurnHead.model_validate_json(raw) for raw in raws if raw is not None]
            await self._count_quality([(head, None) for head in heads])

    async def _forget(self, raws: list[str | None]) -> None:
        async with self.store.client.pipeline(transaction=False) as pipe:
            for raw in raws:
                if raw is not None:
                    self.store.queue_drop(pipe, TurnHead.model_validate_json(raw))
            await pipe.execute()

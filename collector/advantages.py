"""Advantages from judged scores: group-normalised, or against a running baseline.

When a request asked for several samples (n > 1) they share a group key and arrive close
together; `GroupAssembler` holds each group open for `group_wait_s` after its first sample,
then the group is closed. A group of two or more gets advantages (score - mean) / (std + eps)
(all zero when every sample scored the same); a lone sample gets score minus a running
baseline, an exponential moving average with bias correction, so the first scores are not
measured against an arbitrary zero. The very first score of a baseline has nothing to be
measured against and gets no advantage: against zero, a new tenant's or judge's first
replies would be pushed down (or up) for nothing but the scale of the scores, and under
`trainer.skip_flat_samples` a batch holding little else would cost an update and a gate
round.

There is one baseline per judge (or one that all judges share, `baseline_per_judge` off:
for judges that score the same outcome on one scale, such as explicit feedback at the end of
a session and the rules judge's reading of the user's replies before it) and, with
`baseline_scope = "task"`, one per judge and *task*: turns whose requests share a system
prompt and a set of offered tools (`task_key`). Tasks differ in how often they please: a
task the policy never gets right (a tool it does not call yet) scored against the
judge-wide mean pushes down every reply it gives, round after round, and with it whatever
those replies share with the good replies of other tasks (their length, their opening).
Against its own baseline a task that always fails teaches nothing, and its first success
stands out. A task with fewer than
`min_task_turns` scores uses the judge's baseline. The baselines are state that must
survive a restart (a collector starting from zero would measure the next scores against
nothing): `Baselines.dump`/`load` give them a JSON form the loop keeps in Redis.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass, field

from liveloop.config.collector import BaselineScope
from liveloop.contracts import BatchSample, SampleHint, ScoredTurn, TurnRecord
from liveloop.samples import min_version

GROUP_STD_EPS = 1e-6
TASK_MARK = "#task:"  # a task baseline's name: <judge>#task:<task key>
POOLED = "pooled"  # the baseline's name when judges share one (`per_judge` off)


def task_key(turn: TurnRecord) -> str:
    """The task a turn belongs to: a short digest of its system prompt and offered tools.

    An agent's system prompt and tools say what it was asked to do; the user's own words
    do not enter the key, so every conversation of one agent shares it.
    """
    system = [m.get("content") for m in turn.messages if m.get("role") in ("system", "developer")]
    tools = sorted(str((t.get("function") or {}).get("name", "")) for t in turn.tools or [])
    text = json.dumps([system, tools], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass
class PendingSample:
    """A judged turn waiting to be packed, with the stream entry to acknowledge with it."""

    entry_id: str
    turn: ScoredTurn
    arrived_at: float
    advantage: float = 0.0

    @property
    def key(self) -> str:
        """Idempotency key of the turn (session, turn index, sample index)."""
        return self.turn.key

    @property
    def tokens(self) -> int:
        """Prompt + completion tokens."""
        return self.turn.num_tokens

    @property
    def oldest_version(self) -> int:
        """The version of the turn's oldest token (what staleness is measured by)."""
        return min_version(self.turn)

    @property
    def main_version(self) -> int:
        """The version that produced most of the turn's tokens (for reward per version)."""
        return Counter(self.turn.versions).most_common(1)[0][0] if self.turn.versions else 0

    def to_batch_sample(self) -> BatchSample:
        """The compact form that goes into a training batch.

        A turn with a directive hint carries it with its request messages and tools, from
        which the trainer builds the teacher's prompt; other turns carry no text at all.
        """
        t = self.turn
        hint = None
        if t.directive_hint:
            hint = SampleHint(text=t.directive_hint, messages=t.messages, tools=t.tools)
        return BatchSample(
            key=t.key,
            prompt_token_ids=t.prompt_token_ids,
            completion_token_ids=t.completion_token_ids,
            logprobs=t.logprobs,
            versions=t.versions,
            advantage=self.advantage,
            score=t.score,
            hint=hint,
        )


@dataclass
class RunningBaseline:
    """Bias-corrected exponential moving average of one judge's scores."""

    decay: float
    raw: float = 0.0
    count: int = 0

    @property
    def value(self) -> float:
        """The current baseline (0 before any score)."""
        if self.count == 0:
            return 0.0
        return self.raw / (1.0 - self.decay**self.count)

    def update(self, score: float) -> None:
        """Fold one score in."""
        self.raw = self.decay * self.raw + (1.0 - self.decay) * score
        self.count += 1


@dataclass
class Baselines:
    """Running baselines: one per judge and, with scope "task", one per judge and task.

    Task baselines are kept for the `max_tasks` most recently scored tasks; the names of
    those dropped are kept until `take_dropped()` so their stored state can be removed too.
    """

    decay: float
    scope: BaselineScope = "judge"
    min_task_turns: int = 4
    max_tasks: int = 256
    per_judge: bool = True
    by_judge: dict[str, RunningBaseline] = field(default_factory=dict)
    by_task: dict[str, RunningBaseline] = field(default_factory=dict)  # oldest first
    _dropped: list[str] = field(default_factory=list, init=False, repr=False)

    def get(self, judge: str) -> RunningBaseline:
        """The judge's baseline, created on first use."""
        if judge not in self.by_judge:
            self.by_judge[judge] = RunningBaseline(self.decay)
        return self.by_judge[judge]

    def judge_of(self, turn: ScoredTurn) -> str:
        """The name of the judge-wide baseline the turn counts in: its judge's, or the one
        all judges share when `per_judge` is off."""
        return turn.judge if self.per_judge else POOLED

    def task_name(self, turn: ScoredTurn) -> str | None:
        """The name of the turn's task baseline; None with scope "judge"."""
        if self.scope != "task":
            return None
        return f"{self.judge_of(turn)}{TASK_MARK}{task_key(turn)}"

    def value_for(self, turn: ScoredTurn, task: str | None) -> float | None:
        """The baseline a lone turn is measured against (`task`: its `task_name`); None
        before its judge has scored anything."""
        baseline = self.by_task.get(task) if task is not None else None
        if baseline is not None and baseline.count >= self.min_task_turns:
            return baseline.value
        judge = self.get(self.judge_of(turn))
        return judge.value if judge.count else None

    def update(self, turn: ScoredTurn, task: str | None) -> None:
        """Fold the turn's score into its judge's baseline (and its task's, if `task`)."""
        self.get(self.judge_of(turn)).update(turn.score)
        if task is None:
            return
        baseline = self.by_task.pop(task, None) or RunningBaseline(self.decay)
        baseline.update(turn.score)
        self.by_task[task] = baseline  # now the most recent
        while len(self.by_task) > self.max_tasks:
            oldest = next(iter(self.by_task))
            del self.by_task[oldest]
            self._dropped.append(oldest)

    def take_dropped(self) -> list[str]:
        """Names of task baselines dropped since the last call."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def dump(self, judges: set[str] | None = None) -> dict[str, str]:
        """JSON state of the baselines (of `judges` only, if given), by name."""
        named = {**self.by_judge, **self.by_task}
        return {
            name: json.dumps({"raw": b.raw, "count": b.count})
            for name, b in named.items()
            if judges is None or name.split(TASK_MARK, 1)[0] in judges
        }

    def load(self, state: dict[str, str]) -> None:
        """Restore baselines from `dump()` output; unreadable entries are skipped."""
        for name, raw in state.items():
            try:
                data = json.loads(raw)
                baseline = RunningBaseline(self.decay, float(data["raw"]), int(data["count"]))
            except (ValueError, TypeError, KeyError):
                continue
            if baseline.count < 0 or not math.isfinite(baseline.raw):
                continue
            if TASK_MARK not in name:
                self.by_judge[name] = baseline
            elif self.scope == "task" and len(self.by_task) < self.max_tasks:
                self.by_task[name] = baseline
            else:  # not kept: its stored state goes with the next write
                self._dropped.append(name)

    def assign(self, group: list[PendingSample]) -> None:
        """Set the advantages of a closed group, then fold its scores into the baselines."""
        tasks = [self.task_name(p.turn) for p in group]
        if len(group) >= 2:
            scores = [p.turn.score for p in group]
            mean = sum(scores) / len(scores)
            std = math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores))
            for p in group:
                p.advantage = 0.0 if std < GROUP_STD_EPS else (p.turn.score - mean) / std
        else:
            baseline = self.value_for(group[0].turn, tasks[0])
            group[0].advantage = 0.0 if baseline is None else group[0].turn.score - baseline
        for p, task in zip(group, tasks, strict=True):
            self.update(p.turn, task)


class GroupAssembler:
    """Holds samples by group key until `group_wait_s` after each group's first arrival."""

    def __init__(self, group_wait_s: float) -> None:
        self.group_wait_s = group_wait_s
        self._groups: dict[str, list[PendingSample]] = {}
        self._opened: dict[str, float] = {}

    def __len__(self) -> int:
        return sum(len(g) for g in self._groups.values())

    def add(self, sample: PendingSample) -> bool:
        """Add a sample; False (ignored) when the same turn key is already in its group."""
        key = sample.turn.group_key
        group = self._groups.setdefault(key, [])
        if any(p.key == sample.key for p in group):
            return False
        if not group:
            self._opened[key] = sample.arrived_at
        group.append(sample)
        return True

    def pop_closed(self, now: float) -> list[list[PendingSample]]:
        """Groups whose wait is over, in the order they were opened."""
        closed = [k for k, t in self._opened.items() if now - t >= self.group_wait_s]
        result = []
        for key in closed:
            del self._opened[key]
            result.append(sorted(self._groups.pop(key), key=lambda p: p.turn.sample_index))
        return result

    def drop_tenant(self, tenant: str) -> list[PendingSample]:
        """Remove the waiting samples of `tenant` (deleted); returns them."""
        dropped: list[PendingSample] = []
        for key in list(self._groups):
            if self._groups[key] and self._groups[key][0].turn.tenant == tenant:
                dropped += self._groups.pop(key)
                self._opened.pop(key, None)
        return dropped

    def holds(self, key: str) -> bool:
        """True when a turn with this idempotency key is waiting in a group."""
        return any(p.key == key for g in self._groups.values() for p in g)

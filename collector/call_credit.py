"""Credit a tool call with the judgment of the answer it led to.

A reply that calls a tool is judged on what came next: the tool's result. A result without
an error scores `tool_ok_score` whatever the agent then made of it, so a call that led to a
good answer and one that led to a bad one look alike, and the reply that skipped the tool
and made an answer up is judged against a different thing (the user's reaction). A call is
worth what it led to: the judged turn that answered it, the assistant's next reply, whose
request ends with the call's results.

`CallCredit` sits between the prompt groups and the advantages: a closed group of one
sample whose reply made tool calls is held (its stream entry stays pending) until the turn
answering it has been judged, and its score becomes `(1 - weight) x its own + weight x the
answer's`. An answer that is itself a call passes its credited score back once its own
answer is judged, so a chain of calls is credited by the final answer. A call whose answer
is not judged within `wait_s` (the agent gave up, or its last turn was never judged) goes on
with its own score. The answer is found by the OpenAI contract: its request carries the
call's ids in the tool messages that end it. Groups of several samples (n > 1) are not held:
only one sample's calls can have been run, and the group is normalised as it is.

What waits here is in memory only; its stream entries stay pending, so a restarted collector
reads the calls again and they wait again. An answer already published in a batch before the
restart is not read again: such a call goes on with its own score after the wait.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from liveloop.collector.advantages import PendingSample
from liveloop.contracts import TOOL_ROLES, ScoredTurn


def call_ids(turn: ScoredTurn) -> list[str]:
    """The ids of the tool calls the turn's reply made (none for a plain answer)."""
    calls = turn.response.get("tool_calls") or []
    return [str(c.get("id")) for c in calls if isinstance(c, dict) and c.get("id")]


def answered_ids(turn: ScoredTurn) -> list[str]:
    """The call ids that the tool messages at the end of the turn's request answer."""
    ids: list[str] = []
    for message in reversed(turn.messages):
        if message.get("role") not in TOOL_ROLES:
            break
        if message.get("tool_call_id"):
            ids.append(str(message["tool_call_id"]))
    return ids


@dataclass
class HeldCall:
    """A lone call turn waiting for its answer's judgment."""

    sample: PendingSample
    since: float
    ids: list[str]  # its calls' ids (`call_ids`)
    waiting_on_me: list[str] = field(default_factory=list)  # keys of earlier calls in a chain


@dataclass
class KnownAnswer:
    """An answer judged before its call arrived here (judges may reorder turns)."""

    score: float
    at: float


class CallCredit:
    """Holds lone call turns until their answer is judged; see the module docstring.

    `route(groups, now)` takes the closed groups and returns those ready for advantages:
    everything but the calls still waiting, plus the calls resolved by an answer in
    `groups` or released because they waited `wait_s`. With `weight` 0 nothing is held.
    """

    def __init__(self, weight: float, wait_s: float) -> None:
        self.weight = weight
        self.wait_s = wait_s
        self._held: dict[str, HeldCall] = {}  # by turn key
        self._by_call: dict[tuple[str, str], str] = {}  # (session, call id) -> turn key
        self._early: dict[tuple[str, str], KnownAnswer] = {}
        self.credited = 0  # calls that got their answer's judgment
        self.expired = 0  # calls that waited out `wait_s` and kept their own score

    def __len__(self) -> int:
        return len(self._held)

    def route(self, groups: list[list[PendingSample]], now: float) -> list[list[PendingSample]]:
        """The groups ready for advantages now (see the class docstring)."""
        if self.weight <= 0:
            return groups
        ready: list[list[PendingSample]] = []
        for group in groups:
            lone = group[0] if len(group) == 1 else None
            answered = self._answer_target(lone) if lone is not None else None
            if lone is not None and call_ids(lone.turn):
                ready += self._hold(lone, now, answered)
            else:
                ready.append(group)
                if lone is not None and answered is not None:
                    ready += self._resolve(answered, lone.turn.score)
                elif lone is not None:
                    self._remember_early(lone, now)
        ready += self._expire(now)
        return ready

    def drop_tenant(self, tenant: str) -> list[PendingSample]:
        """Forget the held calls of a deleted tenant; returns them (to acknowledge)."""
        gone = [k for k, h in self._held.items() if h.sample.turn.tenant == tenant]
        return [self._forget(k).sample for k in gone]

    def _answer_target(self, sample: PendingSample) -> str | None:
        """The key of the held call this turn answers, if one is held."""
        session = sample.turn.session_id
        for call_id in answered_ids(sample.turn):
            key = self._by_call.get((session, call_id))
            if key is not None:
                return key
        return None

    def _hold(
        self, sample: PendingSample, now: float, answered: str | None
    ) -> list[list[PendingSample]]:
        """Hold a lone call (a link in `answered`'s chain, if given); resolved at once
        when its answer was judged first."""
        key, session, ids = sample.key, sample.turn.session_id, call_ids(sample.turn)
        self._held[key] = HeldCall(sample, now, ids, [answered] if answered is not None else [])
        for call_id in ids:
            self._by_call[(session, call_id)] = key
        for call_id in ids:
            early = self._early.pop((session, call_id), None)
            if early is not None:
                return self._resolve(key, early.score)
        return []

    def _resolve(self, key: str, answer_score: float) -> list[list[PendingSample]]:
        """Credit the held call `key` with `answer_score`, then the calls waiting on it."""
        held = self._held.get(key)
        if held is None:
            return []
        self._forget(key)
        own = held.sample.turn.score
        credited = (1.0 - self.weight) * own + self.weight * answer_score
        held.sample.turn = held.sample.turn.model_copy(update={"score": credited})
        self.credited += 1
        ready = [[held.sample]]
        for earlier in held.waiting_on_me:
            ready += self._resolve(earlier, credited)
        return ready

    def _forget(self, key: str) -> HeldCall:
        held = self._held.pop(key)
        for call_id in held.ids:
            self._by_call.pop((held.sample.turn.session_id, call_id), None)
        return held

    def _remember_early(self, sample: PendingSample, now: float) -> None:
        for call_id in answered_ids(sample.turn):
            self._early[(sample.turn.session_id, call_id)] = KnownAnswer(sample.turn.score, now)

    def _expire(self, now: float) -> list[list[PendingSample]]:
        """Release the calls that waited `wait_s` with their own score (and their chains)."""
        self._early = {k: a for k, a in self._early.items() if now - a.at < self.wait_s}
        ready: list[list[PendingSample]] = []
        for key in [k for k, h in self._held.items() if now - h.since >= self.wait_s]:
            held = self._held.get(key)
            if held is None:  # released with a chain already
                continue
            self._forget(key)
            self.expired += 1
            ready.append([held.sample])
            for earlier in held.waiting_on_me:
                ready += self._resolve(earlier, held.sample.turn.score)
        return ready

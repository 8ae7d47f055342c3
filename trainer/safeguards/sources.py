"""Where the promotion gate's probes come from: the operator, the served traffic, or a plugin.

A probe source draws the probe set the gate answers with each candidate's weights. The gate
compares a candidate only with versions probed on the same set, so when a source draws a new
set (after `trainer.gate.refresh_versions` candidates, for sources that refresh), the gate
probes version 0 and the serving version on it again first.

Built in, by `trainer.gate.probe_source`:
- `prompts`: the operator's `trainer.gate.prompts`, one user message each;
- `served`: a seeded sample of recent main turns from `liveloop:turns`, their requests as
  they were served (side turns are never drawn, opted-out requests were never recorded,
  and with `tenant` set, no other tenant's turn); a set drawn short is topped up;
- `auto` (the default): `prompts` when there are any, else `served`.
Both give each probe the topic its last user message names
(`liveloop.reading.question_topic`), so the gate's topic rate applies to them.
Any other name is looked up in the `liveloop.probe_sources` entry-point group (the demo
registers `demo`, its held-out simulated users, there) and checked when the trainer starts.
LiveLoop's own `demo` is also known without an installed distribution, so a source checkout
on PYTHONPATH (which has no entry points) finds it too; an installed entry point of the same
name takes precedence.
The contract (`Probe`, `ProbeSource`, `ProbeContext`) is `liveloop.probe_sources`.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import Any

from liveloop import bus
from liveloop.config import ConfigError
from liveloop.config.gate import GateSettings
from liveloop.contracts import TurnRecord
from liveloop.plugins import named_plugins
from liveloop.probe_sources import Probe, ProbeContext, ProbeSource
from liveloop.reading import question_topic

log = logging.getLogger(__name__)

GROUP = "liveloop.probe_sources"


class OperatorPrompts(ProbeSource):
    """The operator's prompts (`trainer.gate.prompts`), one user message each."""

    name = "prompts"

    async def draw(self) -> list[Probe]:
        """The configured prompts, as they are, each with the topic it names."""
        return [
            Probe.asking(text, topic=question_topic(text)) for text in self.context.gate.prompts
        ]


class ServedPrompts(ProbeSource):
    """A fixed, seeded sample of the requests most recently served (main turns only).

    A set drawn short (less traffic than `served_probes` requests) is topped up when drawn
    again: its probes still among the recent requests stay, and a seeded sample of the
    others fills it, so the gate's baselines answer only the added probes. A full set is
    drawn afresh (newer traffic) when the gate asks for one.
    """

    name = "served"
    refreshes = True

    def __init__(self, context: ProbeContext) -> None:
        super().__init__(context)
        self._short_set: set[str] = set()  # the last set's request keys, while it fell short

    async def draw(self) -> list[Probe]:
        """Up to `served_probes` distinct recent requests, sampled with the gate's seed (all
        of the last set's still recent probes among them when that set fell short), newest
        first: a set is the same list however it was drawn (topped up or at once)."""
        recent = {_probe_key(p): p for p in await self._recent()}  # newest first
        kept = self._short_set & recent.keys()
        others = [p for key, p in recent.items() if key not in kept]
        added = self._sample(others, self.context.gate.seed, "", room=len(kept))
        chosen = kept | {_probe_key(p) for p in added}
        drawn = [p for key, p in recent.items() if key in chosen]
        if kept:
            log.info("gate probes: %d kept from the last set, which fell short", len(kept))
        self._short_set = chosen if self.fell_short(drawn) else set()
        return drawn

    async def draw_more(self, taken: list[Probe]) -> list[Probe]:
        """Up to `served_probes` more distinct recent requests, none of them in `taken`."""
        known = {_probe_key(p) for p in taken}
        candidates = [p for p in await self._recent() if _probe_key(p) not in known]
        return self._sample(candidates, self.context.gate.seed + 1, "more ")

    def _sample(self, candidates: list[Probe], seed: int, more: str, room: int = 0) -> list[Probe]:
        """Up to `served_probes` (less `room`, probes already taken) of the candidates,
        sampled with `seed`."""
        count = min(self.context.gate.served_probes - room, len(candidates))
        drawn = random.Random(seed).sample(candidates, count)
        log.info(
            "gate probes: %d %sserved requests drawn from %d", len(drawn), more, len(candidates)
        )
        return drawn

    async def _recent(self) -> list[Probe]:
        """The distinct requests among the newest `served_scan` turns this source may use."""
        client = self.context.redis
        if client is None:
            raise RuntimeError("the served probe source needs the stream bus")
        entries = await client.xrevrange(
            bus.stream_key(bus.TURNS), count=self.context.gate.served_scan
        )
        seen: dict[str, Probe] = {}
        for turn in bus.decode_entries(entries or [], TurnRecord):
            if not self._eligible(turn):
                continue
            key = _request_key(turn.messages, turn.tools)
            if key not in seen:  # the newest of repeated requests; its topic read once
                seen[key] = served_probe(turn)
        return list(seen.values())

    def fell_short(self, probes: list[Probe]) -> bool:
        """Fewer than `served_probes`: too little traffic had been served when drawn."""
        return len(probes) < self.context.gate.served_probes

    def _eligible(self, turn: TurnRecord) -> bool:
        tenant = self.context.tenant
        return turn.turn_type == "main" and (tenant is None or turn.tenant == tenant)


def _probe_key(probe: Probe) -> str:
    """What makes two probes the same served request."""
    return _request_key(probe.messages, probe.tools)


def _request_key(messages: Any, tools: Any) -> str:
    """What makes two served requests the same probe."""
    return repr((messages, tools))


def served_probe(turn: TurnRecord) -> Probe:
    """A served turn's request as a probe, with the topic its last user message names."""
    probe = Probe(list(turn.messages), turn.tools)
    return dataclasses.replace(probe, topic=question_topic(probe.question))


BUILTIN: dict[str, type[ProbeSource]] = {"prompts": OperatorPrompts, "served": ServedPrompts}
# LiveLoop's own plug-in sources, by the entry point its package declares for each.
SHIPPED = {"demo": "liveloop.demo.gate_probes:HeldOutUsers"}


def probe_source_class(gate: GateSettings) -> type[ProbeSource]:
    """The class `trainer.gate.probe_source` names (ConfigError for an unknown one)."""
    name = gate.probe_source
    if name == "auto":
        name = "prompts" if gate.prompts else "served"
    if name in BUILTIN:
        return BUILTIN[name]
    found = named_plugins(GROUP, SHIPPED)
    if name not in found:
        known = ", ".join(sorted({"auto", *BUILTIN, *found}))
        raise ConfigError(f"trainer.gate.probe_source: unknown source {name!r} (known: {known})")
    loaded = found[name].load()
    if not (isinstance(loaded, type) and issubclass(loaded, ProbeSource)):
        raise ConfigError(f"trainer.gate.probe_source: {name!r} is not a ProbeSource")
    return loaded

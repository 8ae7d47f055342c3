"""The demo's held-out simulated users as the promotion gate's probes (probe source `demo`).

Registered in the `liveloop.probe_sources` entry-point group, so the trainer finds it by
name (`trainer.gate.probe_source = "demo"`, which the demo presets set) without importing
the demo. Each held-out user asks one question and reacts to the reply as it would in a
session, so the rules judge can score the probe replies; the question's topic gives the
gate its topic rate.
"""

from __future__ import annotations

import random

from liveloop.config.defaults import model_defaults
from liveloop.demo.preferences import Question, WordLimit, make_population
from liveloop.probe_sources import Probe, ProbeSource, Reactor


def _reactor(user: WordLimit, question: Question) -> Reactor:
    return lambda reply, rng: user.react(question, reply, rng).text


class HeldOutUsers(ProbeSource):
    """One question from each of `trainer.gate.probe_users` held-out users (seeded)."""

    name = "demo"

    async def draw(self) -> list[Probe]:
        """The same questions from the same users every time."""
        gate = self.context.gate
        defaults = model_defaults(self.context.shared.model)
        people = make_population(
            gate.probe_users, gate.seed, defaults.word_limits, strict=defaults.has_language
        )
        probes = []
        for i, person in enumerate(people):
            question = person.ask(random.Random(gate.seed + i))
            topic = question.topic.forms if question.topic else None
            probes.append(
                Probe.asking(question.text, topic=topic, react=_reactor(person, question))
            )
        return probes

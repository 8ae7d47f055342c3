"""A probe set answered by a policy's weights, judged and measured: what the promotion gate sees.

A probe is a request (its messages, and tools if any) from a probe source
(`liveloop.trainer.safeguards.sources`): an operator's prompt, a recent served prompt, or a
question of the demo's held-out simulated users. A probe may carry how its asker reacts to a
reply; the reaction is then the next state the configured judges score, exactly as in the
judging loop, and without one the judges score the reply alone. Replies are sampled in one
batch (`liveloop.trainer.safeguards.sampling`), each with random numbers of its own, seeded
by what the probe asks (`probe_seeds`): two versions answer the same question with the same
random numbers, which keeps their comparison tight, whichever other probes share the batch,
so a version's reply to a probe measured once can stand in any later set that holds the
probe. The sampling model's own log-probs of the sampled tokens come from the logits of the
decoding itself, so only the reference model runs a second pass: each reply's NLL per token
under it (how unnatural the reply is) and a k3 estimate of the KL from the policy to the
reference.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from liveloop.contracts import BatchSample, TurnRecord
from liveloop.prm.judges.base import JudgeRequest, NextState
from liveloop.prm.panel import JudgePanel
from liveloop.probe_sources import Probe
from liveloop.reading import ReplyReading, distinct_n, read_reply
from liveloop.seeds import derived_seed
from liveloop.sense import SenseReport
from liveloop.trainer.data import MicroBatch, build_micro_batch
from liveloop.written_calls import written_call

if TYPE_CHECKING:
    import torch

EXAMPLES_KEPT = 6


class ProbeReply(BaseModel):
    """A probe's reply and what became of it."""

    question: str
    reply: str
    reaction: str | None = None
    score: float | None = None


class ProbeMarks(BaseModel):
    """What a reader noticed in one probe reply (None: not measured, e.g. a tool call), so
    that two versions' answers to the same probes can be compared probe by probe."""

    on_topic: bool | None = None
    no_answer: bool | None = None
    sensible: bool | None = None


class ProbeResult(BaseModel):
    """One version's answers to the probe set, judged and measured against the reference."""

    version: int
    probes: int
    scored: int = Field(description="Probes the judges could score.")
    reward: float | None = Field(None, description="Mean judged score of the scored probes.")
    ref_nll: float = Field(description="Reference NLL per reply token.")
    kl_ref: float = Field(description="k3 KL(policy || reference) per reply token.")
    mean_words: float
    distinct_2: float | None
    topic_rate: float | None = Field(None, description="Share of replies naming the topic.")
    symbol_share: float = Field(description="Share of answers dominated by symbols or markup.")
    nonsense_share: float = Field(
        0.0,
        description="Share of answers a reader could not read as an answer: nonsense (invented "
        "or rare words, word salad), symbols, markup or repeats (off-topic replies aside).",
    )
    tool_call_share: float | None = Field(
        None,
        description="Share of the probes offering tools whose reply called one. Those replies "
        "are calls, not answers: the measures above (words to symbols) leave them out.",
    )
    sense_rate: float | None = Field(
        None, description="Share of replies the sense judge read as sensible answers."
    )
    sense_seconds: float = Field(0.0, description="Seconds the sense judge took.")
    seconds: float = 0.0
    examples: list[ProbeReply] = Field(default_factory=list)
    marks: list[ProbeMarks] = Field(
        default_factory=list,
        exclude=True,
        description="Each probe's marks, in probe order (not stored with the version).",
    )


@dataclass
class Sampled:
    """Prompt and completion token ids of every probe, the reply texts, and each completion
    token's log-prob under the model that sampled it (untempered)."""

    prompts: list[list[int]]
    completions: list[list[int]]
    texts: list[str]
    logprobs: list[torch.Tensor]


@dataclass
class Measured:
    """One version's judged replies to a probe set and the log-probs they were measured
    with, kept so that its measures on two sets can be pooled into one result (`pooled`)."""

    version: int
    probes: list[Probe]
    replies: list[ProbeReply]
    logprobs: list[torch.Tensor]  # each reply token's under the sampling model
    reference: list[torch.Tensor]  # and under the reference model
    sense: SenseReport | None = None
    seconds: float = 0.0

    def result(self) -> ProbeResult:
        """The probe result these replies give."""
        result = summarise(self.version, self.probes, self.replies, self.logprobs, self.reference)
        if self.sense is not None:
            result.sense_rate, result.sense_seconds = self.sense.rate, self.sense.seconds
            for mark, verdict in zip(result.marks, self.sense.verdicts, strict=True):
                mark.sensible = verdict
        result.seconds = self.seconds
        return result


def pieces(measured: Measured) -> list[Measured]:
    """One version's measures split probe by probe (each with its share of the seconds)."""
    n = len(measured.probes)
    share = measured.seconds / max(n, 1)
    sense = measured.sense
    return [
        Measured(
            measured.version,
            [measured.probes[i]],
            [measured.replies[i]],
            [measured.logprobs[i]],
            [measured.reference[i]],
            None if sense is None else SenseReport([sense.verdicts[i]], sense.seconds / n),
            share,
        )
        for i in range(n)
    ]


def joined(parts: list[Measured], version: int) -> Measured:
    """Measures of one version on several probes (or sets) as one, in the order given."""
    sensed = bool(parts) and all(part.sense is not None for part in parts)
    whole = Measured(version, [], [], [], [], SenseReport([], 0.0) if sensed else None)
    for part in parts:
        whole = pooled(whole, part)
    return whole


def pooled(first: Measured, second: Measured) -> Measured:
    """One version's measures on two probe sets, as if it had answered them as one set."""
    sense = None
    if first.sense is not None and second.sense is not None:
        sense = SenseReport(
            [*first.sense.verdicts, *second.sense.verdicts],
            first.sense.seconds + second.sense.seconds,
        )
    return Measured(
        first.version,
        [*first.probes, *second.probes],
        [*first.replies, *second.replies],
        [*first.logprobs, *second.logprobs],
        [*first.reference, *second.reference],
        sense,
        first.seconds + second.seconds,
    )


def render_prompts(
    tokenizer: Any, probes: list[Probe], tool_result_reminder: str = ""
) -> list[list[int]]:
    """Each probe's prompt ids, rendered exactly as the server renders a request."""
    from liveloop.server.tools.template import ChatTemplate

    template = ChatTemplate(tokenizer, tool_result_reminder)
    return [template.render_ids(p.messages, p.tools) for p in probes]


def probe_seeds(seed: int, prompts: list[list[int]]) -> list[int]:
    """A sampling seed per prompt from the prompt's ids (and how many times the same prompt
    came before it in the list), so that a probe gets the same seed in any set."""
    seen: dict[tuple[int, ...], int] = {}
    seeds = []
    for prompt in prompts:
        nth = seen[tuple(prompt)] = seen.get(tuple(prompt), -1) + 1
        seeds.append(derived_seed(seed, nth, prompt))
    return seeds


def reply_logprobs(
    score: Callable[[MicroBatch], torch.Tensor], sampled: Sampled, device: str
) -> list[torch.Tensor]:
    """Each completion token's log-prob under `score` (a model's), one tensor per probe, on
    the CPU beside the sampled replies' own (`sample_replies`), whatever device scored them."""
    import torch

    samples = [
        BatchSample(
            key=str(i),
            prompt_token_ids=p,
            completion_token_ids=c,
            logprobs=[0.0] * len(c),
            versions=[0] * len(c),
            advantage=0.0,
            score=0.0,
        )
        for i, (p, c) in enumerate(zip(sampled.prompts, sampled.completions, strict=True))
    ]
    with torch.no_grad():
        logp = score(build_micro_batch(samples, device)).cpu()
    return list(torch.split(logp, [len(c) for c in sampled.completions]))


def probe_record(probe: Probe, sampled: Sampled, i: int, version: int, model: str) -> TurnRecord:
    """A turn record of one probe reply, for judges that read the whole turn."""
    n = len(sampled.completions[i])
    return TurnRecord(
        session_id=f"gate-probe-{i}",
        turn_index=0,
        tenant="gate",
        request_id=f"gate-{version}-{i}",
        messages=probe.messages,
        response={"role": "assistant", "content": sampled.texts[i]},
        prompt_token_ids=sampled.prompts[i],
        completion_token_ids=sampled.completions[i],
        logprobs=[0.0] * n,
        versions=[version] * n,
        finish_reason="stop",
        model=model,
    )


async def judge_replies(
    panel: JudgePanel,
    probes: list[Probe],
    sampled: Sampled,
    version: int,
    model: str,
    seeds: Sequence[int],
) -> list[ProbeReply]:
    """React (held-out users, each with the probe's seed) and judge every reply with the
    configured panel."""
    replies: list[ProbeReply] = []
    for i, probe in enumerate(probes):
        text = sampled.texts[i]
        reaction = None
        if probe.react is not None:
            reaction = probe.react(text, random.Random(seeds[i]))
        state = NextState(messages=[{"role": "user", "content": reaction}] if reaction else None)
        record = probe_record(probe, sampled, i, version, model)
        verdict = await panel.judge(JudgeRequest.for_turn(record, state))
        replies.append(
            ProbeReply(
                question=probe.question,
                reply=text,
                reaction=reaction,
                score=verdict.score if verdict else None,
            )
        )
    return replies


def summarise(
    version: int,
    probes: list[Probe],
    replies: list[ProbeReply],
    policy_logp: list[torch.Tensor],
    reference_logp: list[torch.Tensor],
) -> ProbeResult:
    """The probe result of one version from its judged replies and log-probs."""
    import torch

    tokens = sum(len(x) for x in policy_logp)
    nll = -sum(float(r.sum()) for r in reference_logp) / max(tokens, 1)
    d = [r - p for p, r in zip(policy_logp, reference_logp, strict=True)]
    kl = sum(float((torch.exp(x) - x - 1.0).sum()) for x in d) / max(tokens, 1)
    scores = [r.score for r in replies if r.score is not None]
    offered = [bool(p.tools) for p in probes]
    calls = [o and written_call(r.reply) is not None for r, o in zip(replies, offered, strict=True)]
    answers = [(r, p) for r, p, c in zip(replies, probes, calls, strict=True) if not c]
    readings = [read_reply(r.reply, p.topic) for r, p in answers]
    read = iter(readings)
    marks = [ProbeMarks() if call else _marks(next(read)) for call in calls]
    topical = [x.on_topic for x in readings if x.on_topic is not None]
    return ProbeResult(
        version=version,
        probes=len(replies),
        scored=len(scores),
        reward=sum(scores) / len(scores) if scores else None,
        ref_nll=nll,
        kl_ref=kl,
        mean_words=sum(x.words for x in readings) / max(len(readings), 1),
        distinct_2=distinct_n(r.reply for r, _p in answers),
        topic_rate=sum(topical) / len(topical) if topical else None,
        symbol_share=sum(x.dominated_by_symbols for x in readings) / max(len(readings), 1),
        nonsense_share=sum(x.no_answer for x in readings) / max(len(readings), 1),
        tool_call_share=sum(calls) / sum(offered) if any(offered) else None,
        examples=replies[:EXAMPLES_KEPT],
        marks=marks,
    )


def _marks(reading: ReplyReading) -> ProbeMarks:
    return ProbeMarks(on_topic=reading.on_topic, no_answer=reading.no_answer)

"""The sense check done by an LLM judge: does each reply answer its question sensibly?

It is the `llm` judge (`liveloop.prm.judges.llm`) with its own instructions and its own
prompt: the question and the reply, no next state. One vote is asked greedily; a verdict
of GOOD is sense, BAD is not, and NEUTRAL, a tie, or no valid vote is no verdict. The demo
serves a judge model in a process of its own and asks it about the held-out replies; the
promotion gate asks it about its probe replies (`trainer.gate.sense`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence

from liveloop.config.prm import LLMJudgeConfig
from liveloop.config.sense import SenseJudgeSettings
from liveloop.prm.judges.base import JudgeContext, JudgeError
from liveloop.prm.judges.llm import LLMJudge
from liveloop.sense import SenseCheckFactory, SenseReport

SENSE_PROMPT = (
    "You check whether a reply of an AI assistant is a sensible answer to the user's "
    "question. Replies may be cut off at a length limit; that is fine. GOOD: it talks "
    "sensibly about what was asked. BAD: nonsense, word salad, a title instead of an answer, "
    "or about something else. Answer GOOD or BAD."
)
# Worked examples asked before the real pair: without them a small judge model answers BAD
# to nearly every reply; with them it separates answers from nonsense.
EXAMPLES = (
    (
        "Describe rain.",
        "Rain is water that falls from clouds when the droplets grow too heavy. It waters "
        "plants and fills",
        "GOOD",
    ),
    ("Tell me about owls.", "Owls: The Silent Kingdom of Endless Night", "BAD"),
    (
        "Why do people like trains?",
        "People like trains because they are comfortable and you can look out of the window while",
        "GOOD",
    ),
    (
        "Tell me about clocks.",
        "Clock the hills happy, tick is why mother of blue went dancing.",
        "BAD",
    ),
)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + " [...]"


def _asking(question: str, reply: str, max_chars: int) -> str:
    return (
        f"Question: {_cut(question.strip(), max_chars)}\n"
        f"Reply: {_cut(reply.strip(), max_chars) or '(empty)'}\n"
        "Is the reply a sensible answer to the question?"
    )


def sense_prompt(question: str, reply: str, max_chars: int) -> list[dict[str, str]]:
    """The judge conversation for one (question, reply) pair: the instructions, the worked
    examples as earlier turns, then the pair."""
    messages = [{"role": "system", "content": SENSE_PROMPT}]
    for shown_question, shown_reply, verdict in EXAMPLES:
        messages.append(
            {"role": "user", "content": _asking(shown_question, shown_reply, max_chars)}
        )
        messages.append({"role": "assistant", "content": verdict})
    messages.append({"role": "user", "content": _asking(question, reply, max_chars)})
    return messages


class LLMSenseCheck:
    """A sense check asking one judge endpoint, through the `llm` judge's client."""

    def __init__(self, settings: SenseJudgeSettings, base_url: str, model: str | None) -> None:
        self.settings = settings
        self.base_url = base_url
        self.model = model or settings.model
        self._judge: LLMJudge | None = None

    @classmethod
    def from_settings(cls, settings: SenseJudgeSettings) -> LLMSenseCheck:
        """The check the settings name (their base_url must be set)."""
        if not settings.base_url:
            raise ValueError("a sense check needs its judge endpoint (base_url)")
        return cls(settings, settings.base_url, settings.model)

    async def _client(self) -> LLMJudge:
        if self._judge is None:
            model = self.model or await self._first_model()
            config = LLMJudgeConfig(
                base_url=self.base_url,
                model=model,
                api_key=self.settings.api_key,
                votes=self.settings.votes,
                temperature=0.0 if self.settings.votes == 1 else 0.7,
                hints=False,
                max_tokens=self.settings.max_tokens,
                timeout_s=self.settings.timeout_s,
                concurrency=self.settings.concurrency,
                system_prompt=SENSE_PROMPT,
            )
            context = JudgeContext(name="sense", settings=config, model=model)
            self._judge = LLMJudge(context)
        return self._judge

    async def _first_model(self) -> str:
        from openai import AsyncOpenAI

        async with AsyncOpenAI(
            base_url=self.base_url, api_key=self.settings.api_key, timeout=30, max_retries=2
        ) as client:
            models = await client.models.list()
        if not models.data:
            raise JudgeError(f"the sense judge at {self.base_url} serves no model")
        return models.data[0].id

    async def rate(self, pairs: Sequence[tuple[str, str]]) -> SenseReport:
        """A verdict per (question, reply): True sense, False not, None no verdict."""
        started = time.perf_counter()
        judge = await self._client()

        async def one(question: str, reply: str) -> bool | None:
            try:
                result = await judge.ask(sense_prompt(question, reply, self.settings.max_chars))
            except JudgeError:
                return None
            return None if result.score == 0 else result.score > 0

        verdicts = await asyncio.gather(*(one(q, r) for q, r in pairs))
        return SenseReport(list(verdicts), time.perf_counter() - started)

    async def aclose(self) -> None:
        """Close the judge's HTTP client."""
        if self._judge is not None:
            await self._judge.aclose()


def sense_check_factory(settings: SenseJudgeSettings) -> SenseCheckFactory:
    """Checks with these settings for an endpoint known later (the demo's judge server)."""
    return functools.partial(LLMSenseCheck, settings)

"""How often a version's first reply to a weather question calls the weather tool.

The live users' per-version call rate rests on the few weather questions each version was
asked (often under ten), so a change in it is mostly noise. At the end of a demo the same
`demo.tool_probes` held-out weather questions (seeded apart from the users', not recorded)
are asked of version 0 and of the final version, each as a session's first message with the
weather tool offered, and the replies that called it are counted. Each question is sampled
with its own seed, the same for both versions, so the two rates differ by what the versions
learned rather than by the luck of the draw (and a rerun against the same weights repeats).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from openai import APIError, AsyncOpenAI

from liveloop.config.defaults import model_defaults
from liveloop.demo.preferences import WeatherAsker
from liveloop.demo.users import WEATHER_TOOL
from liveloop.seeds import derived_seed
from liveloop.written_calls import written_call

PROBE_SEED_OFFSET = 20_000  # apart from the live (seed) and held-out (seed + 10,000) users
CONCURRENT = 8


def probe_sampling_seed(seed: int, index: int) -> int:
    """The sampling seed of the `index`th probe question of a run with this seed."""
    return derived_seed("weather probe", seed, index)


def probe_questions(count: int, seed: int) -> list[str]:
    """`count` weather questions, the same for every version of a run with this seed."""
    rng = random.Random(seed + PROBE_SEED_OFFSET)
    asker = WeatherAsker(limit=12)
    return [asker.ask(rng).text for _ in range(count)]


async def _ask_all(
    base_url: str, model: str, questions: list[str], seeds: list[int], api_key: str
) -> list[tuple[bool, bool]]:
    """(called the tool, wrote a call as text) for each question's first reply."""
    gate = asyncio.Semaphore(CONCURRENT)
    max_tokens = model_defaults(model).reply_tokens
    async with AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=2) as client:

        async def one(question: str, sampling_seed: int) -> tuple[bool, bool]:
            async with gate:
                completion = await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": question}],
                    tools=[WEATHER_TOOL],  # type: ignore[list-item]
                    max_tokens=max_tokens,
                    temperature=1.0,
                    seed=sampling_seed,
                    extra_headers={"X-LiveLoop-Train": "false"},
                )
            message = completion.choices[0].message
            called = bool(message.tool_calls)
            return called, not called and written_call(message.content or "") is not None

        return await asyncio.gather(*(one(q, s) for q, s in zip(questions, seeds, strict=True)))


def tool_call_rate(
    base_url: str, model: str, count: int, seed: int, api_key: str = "none"
) -> dict[str, Any] | None:
    """The share of `count` probe questions whose first reply called the weather tool, from
    the version served now; None when the server failed to answer."""
    questions = probe_questions(count, seed)
    try:
        seeds = [probe_sampling_seed(seed, i) for i in range(count)]
        replies = asyncio.run(_ask_all(base_url, model, questions, seeds, api_key))
    except APIError:
        return None
    called = sum(c for c, _ in replies)
    return {
        "questions": len(replies),
        "called": called,
        "rate": called / len(replies) if replies else None,
        "written_as_text": sum(w for _, w in replies),
    }

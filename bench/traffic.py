"""Simulated agents for fault and load runs: multi-turn sessions through the official client.

Why: "lost" and "duplicated" are counted against what clients were actually served. Each
simulated agent runs sessions of a few turns (a question, then replies the rules judge reads:
thanks, corrections, tool-free follow-ups), names its session with `X-Session-Id`, streams
some requests, and records every request: its session and turn index (from the response
headers), status, error, latency, time to first token and the policy version it was served
by. `Traffic.run(stop)` keeps `agents` sessions going until `stop` is set; a run may hold
them back between requests through `flowing`.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

REPLIES = (
    "Thanks, that's exactly it.",
    "No, that's wrong. Try again.",
    "Too long, please be brief.",
    "Perfect, thank you!",
    "Hmm, and what about the next step?",
)


@dataclass
class Served:
    """One chat request as the client saw it."""

    session_id: str
    turn_index: int | None
    ok: bool
    status: int
    error: str | None
    started: float
    ended: float
    ttft: float | None
    policy_version: int | None
    stream: bool

    @property
    def key(self) -> str | None:
        """The turn key of sample 0 (as in the turns stream), when the request succeeded."""
        if not self.ok or self.turn_index is None:
            return None
        return f"{self.session_id}:{self.turn_index}:0"

    @property
    def latency(self) -> float:
        """Seconds from sending to the end of the reply."""
        return self.ended - self.started


@dataclass
class Traffic:
    """Concurrent simulated agents against one server."""

    base_url: str
    agents: int = 4
    turns_per_session: int = 3
    max_tokens: int = 8
    stream_share: float = 0.5
    api_key: str = "none"
    model: str = "tiny-random"
    timeout_s: float = 60.0
    seed: int = 0
    think_s: float = 0.0
    # when given, each agent waits for it before every request: a run holds its traffic
    # back by clearing it (set it again, or stop, to let the agents go on)
    flowing: asyncio.Event | None = None
    served: list[Served] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)  # a run's own moments (perf_counter)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    async def run(self, stop: asyncio.Event) -> list[Served]:
        """Run the agents until `stop` is set; each finishes the request it is in."""
        client = openai.AsyncOpenAI(
            base_url=self.base_url + "/v1",
            api_key=self.api_key,
            max_retries=0,
            timeout=self.timeout_s,
            http_client=httpx.AsyncClient(
                limits=httpx.Limits(max_connections=self.agents + 4), timeout=self.timeout_s
            ),
        )
        try:
            await asyncio.gather(*(self._agent(client, i, stop) for i in range(self.agents)))
        finally:
            await client.close()
        return self.served

    async def _agent(self, client: openai.AsyncOpenAI, agent: int, stop: asyncio.Event) -> None:
        rng = random.Random(f"{self.seed}-{agent}")
        n = 0
        while not stop.is_set():
            session_id = f"sess-{self.run_id}-{agent}-{n}"
            n += 1
            messages: list[dict[str, Any]] = [
                {
                    "role": "user",
                    "content": f"Question {n} of agent {agent}: explain topic {n % 9}.",
                }
            ]
            for _turn in range(self.turns_per_session):
                if self.flowing is not None:
                    await self.flowing.wait()
                if stop.is_set():
                    return
                served, text = await self.request(client, session_id, messages, rng)
                self.served.append(served)
                if not served.ok:
                    break
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": rng.choice(REPLIES)},
                ]
                if self.think_s:
                    await asyncio.sleep(rng.uniform(0, 2 * self.think_s))

    async def request(
        self,
        client: openai.AsyncOpenAI,
        session_id: str,
        messages: list[dict[str, Any]],
        rng: random.Random,
    ) -> tuple[Served, str]:
        """One chat request; never raises (failures are recorded)."""
        stream = rng.random() < self.stream_share
        kwargs: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "extra_headers": {"X-Session-Id": session_id},
        }
        started = time.perf_counter()
        ttft: float | None = None
        text = ""
        try:
            if stream:
                async with client.chat.completions.with_streaming_response.create(
                    **kwargs, stream=True
                ) as raw:
                    headers = raw.headers
                    async for chunk in await raw.parse():
                        if ttft is None:
                            ttft = time.perf_counter() - started
                        for choice in chunk.choices:
                            text += choice.delta.content or ""
            else:
                response = await client.chat.completions.with_raw_response.create(**kwargs)
                headers = response.headers
                reply = response.parse()
                text = reply.choices[0].message.content or ""
                ttft = time.perf_counter() - started
        except openai.APIStatusError as exc:
            return self._failed(session_id, started, stream, exc.status_code, exc), ""
        except (openai.APIError, httpx.HTTPError) as exc:
            return self._failed(session_id, started, stream, 0, exc), ""
        index = headers.get("x-turn-index")
        version = headers.get("x-policy-version")
        return Served(
            session_id=session_id,
            turn_index=int(index) if index is not None else None,
            ok=True,
            status=200,
            error=None,
            started=started,
            ended=time.perf_counter(),
            ttft=ttft,
            policy_version=int(version) if version is not None else None,
            stream=stream,
        ), text

    def _failed(
        self, session_id: str, started: float, stream: bool, status: int, exc: Exception
    ) -> Served:
        return Served(
            session_id, None, False, status, f"{type(exc).__name__}: {exc}"[:300], started,
            time.perf_counter(), None, None, stream,
        )  # fmt: skip


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of values by nearest rank; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def latency_summary(served: list[Served]) -> dict[str, Any]:
    """Counts and latency percentiles (ms) of a list of requests."""
    ok = [s for s in served if s.ok]
    lat = [s.latency * 1000 for s in ok]
    ttft = [s.ttft * 1000 for s in ok if s.ttft is not None]
    return {
        "requests": len(served),
        "failed": len(served) - len(ok),
        "latency_ms": {f"p{int(q * 100)}": _round(percentile(lat, q)) for q in (0.5, 0.9, 0.99)},
        "ttft_ms": {f"p{int(q * 100)}": _round(percentile(ttft, q)) for q in (0.5, 0.9, 0.99)},
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)

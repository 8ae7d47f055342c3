"""Synthetic conversations as the server would record them, for tests and the judge benchmark.

Test fixtures: they live with the tests, not in the installed package.

`conversation()` builds the turn records of one session: each turn's request repeats the
previous request, the previous reply and the new user (or tool) messages, exactly the shape
the pairing reads its next state from. `write_turns()` appends them to `liveloop:turns` the
way the server does (dedupe key = turn key, index fields beside `data`).
"""

from __future__ import annotations

import random
from typing import Any

import redis.asyncio as aredis

from liveloop import bus
from liveloop.contracts import TurnRecord, TurnType

Message = dict[str, Any]


def make_turn(
    session_id: str,
    turn_index: int,
    messages: list[Message],
    reply: str,
    *,
    turn_type: TurnType = "main",
    sample_index: int = 0,
    rng: random.Random | None = None,
    prompt_tokens: int | None = None,
    completion_tokens: int = 32,
) -> TurnRecord:
    """One turn record with plausible token data (ids, log-probs, versions)."""
    rng = rng or random.Random(hash((session_id, turn_index, sample_index)) & 0xFFFF)
    n_prompt = prompt_tokens if prompt_tokens is not None else 16 + 24 * len(messages)
    return TurnRecord(
        session_id=session_id,
        turn_index=turn_index,
        turn_type=turn_type,
        tenant="tenant-test",
        request_id=f"req-{session_id}-{turn_index}",
        sample_index=sample_index,
        messages=messages,
        response={"role": "assistant", "content": reply},
        prompt_token_ids=[rng.randrange(49152) for _ in range(n_prompt)],
        completion_token_ids=[rng.randrange(49152) for _ in range(completion_tokens)],
        logprobs=[-rng.random() * 3 for _ in range(completion_tokens)],
        versions=[0] * completion_tokens,
        finish_reason="stop",
        model="tiny-random",
    )


def conversation(
    session_id: str,
    steps: list[Message | list[Message]],
    replies: list[str] | None = None,
    **turn_kwargs: Any,
) -> list[TurnRecord]:
    """Turns of one session: step i holds the new message(s) sent before assistant turn i."""
    history: list[Message] = [{"role": "system", "content": "You are a helpful assistant."}]
    turns: list[TurnRecord] = []
    for i, step in enumerate(steps):
        history = history + (step if isinstance(step, list) else [step])
        reply = replies[i] if replies else f"answer {i} of {session_id}"
        turns.append(make_turn(session_id, i, history, reply, **turn_kwargs))
        history = [*history, {"role": "assistant", "content": reply}]
    return turns


def user(text: str) -> Message:
    """A user message."""
    return {"role": "user", "content": text}


def tool(text: str, call_id: str = "call_0") -> Message:
    """A tool result message."""
    return {"role": "tool", "content": text, "tool_call_id": call_id}


async def write_turns(client: aredis.Redis, turns: list[TurnRecord], chunk: int = 500) -> None:
    """Append turn records to `liveloop:turns` as the server does (pipelined)."""
    for start in range(0, len(turns), chunk):
        async with client.pipeline(transaction=False) as pipe:
            for turn in turns[start : start + chunk]:
                fields = bus.encode(
                    turn,
                    session_id=turn.session_id,
                    turn_index=turn.turn_index,
                    turn_type=turn.turn_type,
                )
                pipe.xadd(bus.stream_key(bus.TURNS), fields)  # type: ignore[arg-type]
            await pipe.execute()

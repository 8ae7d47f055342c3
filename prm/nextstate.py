"""The next state of a turn: which messages of the following turn are new.

Turn t+1's request normally repeats turn t's request, then turn t's reply, then what is new
(a user reply or tool results). Those new messages are the signal a judge reads. When a
client rewrote its history (trimmed, summarised), the messages after the last assistant
message of turn t+1's request are taken instead.
"""

from __future__ import annotations

from typing import Any

from liveloop.prm.judges.base import message_text


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a.get("role") == b.get("role")
        and message_text(a) == message_text(b)
        and a.get("tool_call_id") == b.get("tool_call_id")
    )


def new_messages(
    previous: list[dict[str, Any]], following: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Messages of the following request that came after the previous request and its reply."""
    n = len(previous)
    if (
        len(following) > n
        and following[n].get("role") == "assistant"
        and all(p == f or _same(p, f) for p, f in zip(previous, following, strict=False))
    ):
        return following[n + 1 :]
    for i in range(len(following) - 1, -1, -1):
        if following[i].get("role") == "assistant":
            return following[i + 1 :]
    return following[n:] if len(following) > n else following[-1:]

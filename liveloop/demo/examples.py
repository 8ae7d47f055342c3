"""Directive hints at work: a hint, the reply that earned it, and the final version's reply.

After a demo run the final version is asked again, without recording, the very requests of
a few turns whose judge wrote a directive hint. The report shows each hint with the reply
before (the one the user corrected) and after (the final version's answer to the same
conversation), which is what on-policy distillation is meant to change.
"""

from __future__ import annotations

from typing import Any

import httpx

from liveloop.config.defaults import model_defaults
from liveloop.demo.report import JudgedTurn

NO_TRAIN = {"X-LiveLoop-Train": "false"}


def pick_hinted(turns: list[JudgedTurn], count: int) -> list[JudgedTurn]:
    """Up to `count` hinted turns with different hints, spread over the run."""
    hinted = [t for t in turns if t.hint and t.messages]
    chosen: list[JudgedTurn] = []
    seen: set[str] = set()
    step = max(1, len(hinted) // max(count, 1))
    for turn in hinted[::step] + hinted:
        if len(chosen) == count:
            break
        if turn.hint not in seen:
            seen.add(turn.hint or "")
            chosen.append(turn)
    return chosen


def hint_examples(
    base_url: str, model: str, turns: list[JudgedTurn], version: int, count: int = 4
) -> list[dict[str, Any]]:
    """Hints with the reply before and the reply of the version served now (not recorded)."""
    out = []
    max_tokens = model_defaults(model).reply_tokens
    with httpx.Client(base_url=base_url, timeout=300, headers=NO_TRAIN) as client:
        for turn in pick_hinted(turns, count):
            body: dict[str, Any] = {
                "model": model,
                "messages": turn.messages,
                "max_tokens": max_tokens,
                "temperature": 1.0,
            }
            if turn.tools:
                body["tools"] = turn.tools
            try:
                response = client.post("/v1/chat/completions", json=body)
                response.raise_for_status()
                message = response.json()["choices"][0]["message"]
            except (httpx.HTTPError, KeyError, IndexError, ValueError):
                continue
            after = message.get("content") or ""
            if message.get("tool_calls"):
                call = message["tool_calls"][0]["function"]
                after = f"{after} [tool call {call.get('name')}({call.get('arguments')})]".strip()
            out.append(
                {
                    "hint": turn.hint,
                    "question": turn.question,
                    "version_before": turn.version,
                    "before": turn.reply,
                    "version_after": version,
                    "after": after,
                }
            )
    return out

"""The `llm` judge: LLM-as-judge over any OpenAI-compatible endpoint, with m-vote majority.

By default it asks this LiveLoop server itself (`http://{host}:{port}/v1`); its own judging
requests carry `X-LiveLoop-Train: false` so they are never recorded as training traffic.
Each of the m votes is a separate chat request; a vote that is malformed, errors or times
out is discarded, the majority of the valid votes wins and a tie gives 0. With no valid
vote the judge fails (and the turn is retried by the judging loop).

Each vote may also carry a directive hint: where the next state shows how the reply should
have been different, a short instruction between `[HINT]` and `[/HINT]` (or the `hint` of a
structured vote, `output = "json"`). Of the votes that found one, the longest non-trivial
hint is kept as the turn's `directive_hint`.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from typing import TYPE_CHECKING, Any

from liveloop.config.prm import LLMJudgeConfig
from liveloop.prm.judges.base import (
    JudgeBase,
    JudgeContext,
    JudgeError,
    JudgeRequest,
    JudgeResult,
    longest_hint,
    message_text,
)

if TYPE_CHECKING:
    from openai import AsyncOpenAI

VERDICTS = {"good": 1.0, "bad": -1.0, "neutral": 0.0}
NO_TRAIN_HEADER = {"X-LiveLoop-Train": "false"}

SYSTEM_PROMPT = (
    "You review one reply of an AI assistant. You see the conversation so far, the "
    "assistant's reply, and what happened next: the user's next message, tool results, "
    "explicit feedback, or nothing. Judge whether the reply helped the user. Answer with a "
    "single word on the first line: GOOD, BAD or NEUTRAL."
)
HINT_PROMPT = (
    " Then, only if what happened next shows how the reply should have been different, "
    "write that as one short instruction to the assistant between [HINT] and [/HINT], for "
    "example: [HINT]Answer in two sentences at most.[/HINT]"
)
JSON_PROMPT = (
    "You review one reply of an AI assistant. You see the conversation so far, the "
    "assistant's reply, and what happened next: the user's next message, tool results, "
    "explicit feedback, or nothing. Judge whether the reply helped the user. Answer with a "
    'JSON object: {"verdict": "GOOD", "BAD" or "NEUTRAL", "hint": "..."}, where the hint is '
    "one short instruction to the assistant saying how the reply should have been different, "
    "if what happened next shows it, and an empty string otherwise."
)
HINT_BLOCK = re.compile(r"\[HINT\](.*?)(?:\[/HINT\]|$)", re.IGNORECASE | re.DOTALL)

_LABELLED = re.compile(r"(?:verdict|answer|rating)\W{0,3}(good|bad|neutral)\b", re.IGNORECASE)
_WORD = re.compile(r"\b(good|bad|neutral)\b", re.IGNORECASE)
_FIRST_WORD = re.compile(r"^[\s*_`#>\"'(\[]*([a-z]+)", re.IGNORECASE)


def _from_json(text: str) -> float | None:
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        return None
    try:
        obj = json.loads(text[start : end + 1])
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    verdict = obj.get("verdict")
    if isinstance(verdict, str) and verdict.strip().lower() in VERDICTS:
        return VERDICTS[verdict.strip().lower()]
    score = obj.get("score")
    if isinstance(score, int | float) and not isinstance(score, bool) and -1 <= score <= 1:
        return float(score)
    return None


def parse_vote(text: str | None) -> float | None:
    """One vote from a judge reply: 1 (good), -1 (bad), 0 (neutral), or None if malformed.

    Accepted, in order: a JSON object with `verdict` or `score`; "verdict: X"; a reply whose
    first word is a verdict (and its first line names no other); a reply that names exactly one distinct verdict word.
    """
    if not text or not text.strip():
        return None
    found = _from_json(text)
    if found is not None:
        return found
    labelled = _LABELLED.search(text)
    if labelled:
        return VERDICTS[labelled.group(1).lower()]
    first = _FIRST_WORD.match(text)
    first_line = {w.lower() for w in _WORD.findall(text.strip().splitlines()[0])}
    if first and first.group(1).lower() in VERDICTS and len(first_line) == 1:
        return VERDICTS[first.group(1).lower()]
    words = {w.lower() for w in _WORD.findall(text)}
    if len(words) == 1:
        return VERDICTS[words.pop()]
    return None


def parse_hint(text: str | None) -> tuple[str, str | None]:
    """(the reply without its hint block, the hint or None) of one judge reply.

    The hint is the text of a `[HINT]...[/HINT]` block (an unclosed block runs to the end),
    or the string `hint` of a JSON reply. The block is removed so that words in the hint
    ("a good answer names...") are not read as the verdict.
    """
    if not text:
        return "", None
    found = HINT_BLOCK.search(text)
    if found:
        return text[: found.start()] + text[found.end() :], found.group(1).strip() or None
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        try:
            obj = json.loads(text[start : end + 1])
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("hint"), str):
            return text, obj["hint"].strip() or None
    return text, None


def vote_schema(max_hint_chars: int) -> dict[str, Any]:
    """The built-in JSON schema of one structured vote."""
    return {
        "type": "object",
        "properties": {
            "verdict": {"type": "string", "enum": ["GOOD", "BAD", "NEUTRAL"]},
            "hint": {"type": "string", "maxLength": max_hint_chars},
        },
        "required": ["verdict", "hint"],
        "additionalProperties": False,
    }


def vote_class(vote: float) -> int:
    """The side a vote is on: -1, 0 or 1 (votes within 1/3 of zero are neutral)."""
    if vote > 1 / 3:
        return 1
    if vote < -1 / 3:
        return -1
    return 0


def majority(votes: list[float]) -> tuple[float, float]:
    """(majority side, disagreement = share of votes not on that side); a tie gives 0."""
    counts = Counter(vote_class(v) for v in votes)
    ranked = counts.most_common()
    tied = len(ranked) > 1 and ranked[1][1] == ranked[0][1]
    winner = 0 if tied else ranked[0][0]
    return float(winner), 1.0 - counts.get(winner, 0) / len(votes)


def _cut(text: str, limit: int, keep_end: bool = False) -> str:
    if len(text) <= limit:
        return text
    return "…" + text[-limit:] if keep_end else text[:limit] + "…"


def render_messages(messages: list[dict[str, Any]]) -> str:
    """Messages as `role: text` lines, tool calls included."""
    lines = []
    for m in messages:
        text = message_text(m)
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            text += f"\n[tool call {fn.get('name')}({fn.get('arguments', '')})]"
        lines.append(f"{m.get('role', '?')}: {text.strip()}")
    return "\n".join(lines)


def system_prompt(config: LLMJudgeConfig) -> str:
    """The judge's instructions: the operator's, or the built-in ones for the output form."""
    if config.system_prompt:
        return config.system_prompt
    if config.output == "json":
        return JSON_PROMPT
    return SYSTEM_PROMPT + (HINT_PROMPT if config.hints else "")


def build_prompt(
    request: JudgeRequest, max_chars: int, system: str = SYSTEM_PROMPT
) -> list[dict[str, str]]:
    """The judge conversation: the user's request, the response and the next state."""
    state = request.next_state
    if state.feedback is not None:
        comment = f" ({state.feedback.comment})" if state.feedback.comment else ""
        nxt = f"explicit feedback from the user: {state.feedback.score:+.2f}{comment}"
    elif state.messages:
        nxt = render_messages(state.messages)
    else:
        nxt = "(nothing: the conversation ended without a reply)"
    body = (
        f"## Conversation\n{_cut(render_messages(request.messages), max_chars, keep_end=True)}\n\n"
        f"## Assistant reply\n{_cut(render_messages([request.response]), max_chars)}\n\n"
        f"## What happened next\n{_cut(nxt, max_chars)}\n\n"
        "Verdict (GOOD, BAD or NEUTRAL):"
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": body}]


class LLMJudge(JudgeBase):
    """m votes from an OpenAI-compatible chat model; majority wins, ties give 0."""

    name = "llm"
    settings_model = LLMJudgeConfig

    def __init__(self, context: JudgeContext) -> None:
        from openai import AsyncOpenAI

        self.config = context.settings_as(LLMJudgeConfig)
        self.model = self.config.model or context.model
        self.base_url = self.config.base_url or context.server_url
        self.hint_chars = context.hint_chars
        self.system = system_prompt(self.config)
        self.extra_body: dict[str, Any] = {}
        if self.config.output == "json":
            schema = self.config.json_schema or vote_schema(self.hint_chars[1])
            self.extra_body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "vote", "schema": schema},
            }
        self._limit = asyncio.Semaphore(self.config.concurrency)
        self.client: AsyncOpenAI = AsyncOpenAI(
            base_url=self.base_url,
            api_key=self.config.api_key,
            timeout=self.config.timeout_s,
            max_retries=0,
            default_headers=NO_TRAIN_HEADER,
        )

    async def score(self, request: JudgeRequest) -> JudgeResult | None:
        """Ask for `votes` verdicts concurrently; the majority, and the longest hint."""
        return await self.ask(build_prompt(request, self.config.max_chars, self.system))

    async def ask(self, prompt: list[dict[str, str]]) -> JudgeResult:
        """The votes on a judge conversation made elsewhere (its system message included):
        the majority, and the longest hint. Raises JudgeError when no vote is valid."""
        outcomes = await asyncio.gather(*(self._vote(prompt, i) for i in range(self.config.votes)))
        valid = [o for o in outcomes if isinstance(o, tuple)]
        if not valid:
            reasons = "; ".join(sorted({str(o) for o in outcomes}))
            raise JudgeError(f"no valid vote from {self.base_url} ({reasons})")
        votes = [vote for vote, _ in valid]
        hints = [hint for _, hint in valid]
        score, disagreement = majority(votes)
        directive = longest_hint(hints, *self.hint_chars) if self.config.hints else None
        return JudgeResult(
            score=score,
            votes=votes,
            hint=f"{len(votes)}/{self.config.votes} valid votes",
            directive_hint=directive,
            extra={"disagreement": disagreement, "vote_hints": hints},
        )

    async def _vote(
        self, prompt: list[dict[str, str]], index: int
    ) -> tuple[float, str | None] | str:
        """(vote, hint) of one vote, or a short reason why it was discarded."""
        try:
            async with self._limit, asyncio.timeout(self.config.timeout_s):
                reply = await self.client.chat.completions.create(
                    model=self.model,
                    messages=prompt,  # type: ignore[arg-type]
                    max_tokens=self.config.max_tokens,
                    temperature=self.config.temperature,
                    seed=index,
                    extra_body=self.extra_body or None,
                )
        except TimeoutError:
            return "timeout"
        except Exception as exc:  # any transport or API error discards this vote
            return f"{type(exc).__name__}: {str(exc)[:200]}"
        text = reply.choices[0].message.content if reply.choices else None
        rest, hint = parse_hint(text)
        vote = parse_vote(rest)
        return "malformed vote" if vote is None else (vote, hint)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self.client.close()

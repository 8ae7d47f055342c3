"""An example judge plugin for LiveLoop: scores replies by how concise they are.

Replace the body of `score` with a call to your own reward model; keep the contract:
return a `JudgeResult` with a finite score in [-1, 1] (optionally `step_scores`, `hint`,
`votes`, and a `directive_hint`: a short instruction saying what the reply should have done
differently, which on-policy distillation puts in front of a teacher), or None when the
judge has no opinion on a turn. Raising, or taking longer than
`prm.judge_timeout_s`, fails the turn, which is retried and finally dead-lettered.

The judge's settings are its own pydantic model (`settings_model`), read from
`[prm.judge_args.concise]` in TOML or `LIVELOOP_PRM__JUDGE_ARGS__CONCISE__WORDS` in the
environment and checked when `liveloop judge` starts.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from liveloop.prm.judges import JudgeBase, JudgeContext, JudgeRequest, JudgeResult, message_text


class ConciseSettings(BaseModel):
    """Settings of the `concise` judge."""

    words: int = Field(50, ge=1, description="Replies of at most this many words score +1.")


class ConciseJudge(JudgeBase):
    """+1 for replies of at most `words` words, falling linearly to -1 at 4 × `words`."""

    name = "concise"
    inline = True  # pure computation: the judging loop needs no task per turn
    settings_model = ConciseSettings

    def __init__(self, context: JudgeContext) -> None:
        self.limit = context.settings_as(ConciseSettings).words

    async def score(self, request: JudgeRequest) -> JudgeResult | None:
        """Score the length of the assistant's reply."""
        words = len(message_text(request.response).split())
        if words <= self.limit:
            score = 1.0
        else:
            score = max(-1.0, 1.0 - 2.0 * (words - self.limit) / (3.0 * self.limit))
        return JudgeResult(
            score=score,
            hint=f"{words} words (limit {self.limit})",
            directive_hint=f"Answer in {self.limit} words at most." if score < 1.0 else None,
        )

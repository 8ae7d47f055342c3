"""The `feedback` judge: explicit feedback from `/v1/feedback`, which wins over inferred signals."""

from __future__ import annotations

from liveloop.config.prm import HINT_CHARS
from liveloop.prm.judges.base import (
    JudgeBase,
    JudgeContext,
    JudgeRequest,
    JudgeResult,
    clean_hint,
)


class FeedbackJudge(JudgeBase):
    """Scores a turn with its explicit feedback (decisive), and has no opinion otherwise.

    The feedback's comment is also the turn's directive hint (when it is not trivial).
    """

    inline = True  # never awaits: the loop may run it without a task per turn
    name = "feedback"

    def __init__(self, context: JudgeContext | None = None) -> None:
        self.context = context
        self._hint_chars = context.hint_chars if context is not None else HINT_CHARS

    async def score(self, request: JudgeRequest) -> JudgeResult | None:
        """The feedback score, marked decisive; None without feedback."""
        feedback = request.next_state.feedback
        if feedback is None:
            return None
        return JudgeResult(
            score=feedback.score,
            hint=feedback.comment,
            directive_hint=clean_hint(feedback.comment, *self._hint_chars),
            decisive=True,
        )

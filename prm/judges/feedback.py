"""The `feedback` judge: explicit feedback from `/v1/feedback`, which wins over inferred signals."""

from __future__ import annotations

from liveloop.prm.judges.base import JudgeBase, JudgeContext, JudgeRequest, JudgeResult


class FeedbackJudge(JudgeBase):
    """Scores a turn with its explicit feedback (decisive), and has no opinion otherwise."""

    inline = True  # never awaits: the loop may run it without a task per turn
    name = "feedback"

    def __init__(self, context: JudgeContext | None = None) -> None:
        self.context = context

    async def score(self, request: JudgeRequest) -> JudgeResult | None:
        """The feedback score, marked decisive; None without feedback."""
        feedback = request.next_state.feedback
        if feedback is None:
            return None
        return JudgeResult(score=feedback.score, hint=feedback.comment, decisive=True)

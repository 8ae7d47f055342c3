"""The `feedback` judge: explicit feedback from `/v1/feedback`, which wins over inferred signals."""

from __future__ import annotations

from typing import TYPE_CHECKING

from liveloop.config.prm import JudgeConfig
from liveloop.prm.judges.base import JudgeRequest, JudgeResult, clean_hint

if TYPE_CHECKING:
    from liveloop.config import LiveLoopSettings


class FeedbackJudge:
    """Scores a turn with its explicit feedback (decisive), and has no opinion otherwise.

    The feedback's comment is also the turn's directive hint (when it is not trivial).
    """

    inline = True  # never awaits: the loop may run it without a task per turn
    name = "feedback"

    def __init__(self, settings: LiveLoopSettings | None = None) -> None:
        self.settings = settings
        judging = settings.prm if settings is not None else JudgeConfig()
        self._hint_chars = judging.hint_chars

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

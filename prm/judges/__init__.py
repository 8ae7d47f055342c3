"""Judge plugins: the `Judge` protocol, the built-in judges and lookup by entry-point name.

Built-in judges live in their own modules (`rules`, `llm`, `feedback`) and are imported only
when configured, so `liveloop judge` with the rules judge never imports the openai client.
"""

from liveloop.prm.judges.base import (
    Judge,
    JudgeBase,
    JudgeContext,
    JudgeError,
    JudgeRequest,
    JudgeResult,
    NextState,
    TurnHead,
    clean_hint,
    longest_hint,
    message_text,
    validate_result,
)
from liveloop.prm.judges.registry import (
    GROUP,
    available_judges,
    judge_context,
    load_judge,
    load_judges,
)

__all__ = [
    "GROUP",
    "Judge",
    "JudgeBase",
    "JudgeContext",
    "JudgeError",
    "JudgeRequest",
    "JudgeResult",
    "NextState",
    "TurnHead",
    "available_judges",
    "clean_hint",
    "judge_context",
    "load_judge",
    "load_judges",
    "longest_hint",
    "message_text",
    "validate_result",
]

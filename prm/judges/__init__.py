"""Judge plugins: the `Judge` protocol, the built-in judges and lookup by entry-point name.

Built-in judges live in their own modules (`rules`, `llm`, `feedback`) and are imported only
when configured, so `liveloop judge` with the rules judge never imports the openai client.
"""

from liveloop.prm.judges.base import (
    Judge,
    JudgeError,
    JudgeRequest,
    JudgeResult,
    NextState,
    Signal,
    TurnHead,
    clean_hint,
    longest_hint,
    message_text,
    validate_result,
)
from liveloop.prm.judges.registry import GROUP, available_judges, load_judge, load_judges

__all__ = [
    "GROUP",
    "Judge",
    "JudgeError",
    "JudgeRequest",
    "JudgeResult",
    "NextState",
    "Signal",
    "TurnHead",
    "available_judges",
    "clean_hint",
    "load_judge",
    "load_judges",
    "longest_hint",
    "message_text",
    "validate_result",
]

"""Settings of hindsight credit from a stated word limit, part of the trainer's settings.

A turn's scalar advantage is spread over every token of its reply. When the reply was judged
badly and the conversation states a word limit the reply went past ("Shorter, please: 25
words at most."), the next state says where the reply went wrong: after its 25th word. The
trainer can then put the (negative) advantage on the tokens past the limit only, instead of
also pushing down the words before it, which the user did not complain about.
"""

import re

from pydantic import Field, field_validator

from liveloop.config.base import Section


class LimitCreditSettings(Section):
    """Where a bad reply's advantage goes when the conversation states a word limit."""

    enabled: bool = Field(
        False,
        description="Put a negatively judged reply's advantage on the tokens past a word limit "
        "stated by its directive hint (or by the user earlier in the conversation), when it "
        "went past.",
    )
    within_weight: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Share of the advantage kept on the tokens within the limit (1.0: as "
        "without this credit).",
    )
    patterns: list[str] = Field(
        default_factory=lambda: [r"\b(\d{1,4})\s+words?\b"],
        description="Regular expressions (case-insensitive) whose first group is the limit, "
        "searched in the directive hint first, then in the request's user messages, latest "
        "first.",
    )

    @field_validator("patterns")
    @classmethod
    def _compiles_with_a_group(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            if re.compile(pattern).groups < 1:
                raise ValueError(f"pattern {pattern!r} needs a group holding the number")
        return patterns

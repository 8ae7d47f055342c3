"""Hindsight credit from a stated word limit: a too-long reply is blamed past the limit only.

The scalar advantage of a turn is the same for every token of its reply. A user who says
"Shorter, please: 25 words at most." after a 40-word reply has said more than how bad it
was: the reply went wrong after its 25th word. With `trainer.limit_credit` on, a turn whose
advantage is negative, whose directive hint (or, failing that, the latest user message of
its conversation that says one) states a word limit, and whose reply went past that limit,
keeps its advantage on the tokens from the first word past the limit and only
`within_weight` of it before. The words the user did not complain about are then not
pushed down with the length, and the push lands where the reply should have ended.

Words are counted as a reader counts them: runs of non-space characters with a letter in
them (a run of symbols is no word). The reply's token ids are decoded, never re-tokenised.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from liveloop.config.credit import LimitCreditSettings
from liveloop.contracts import BatchSample

PIECE = re.compile(r"\S+")


def count_words(text: str) -> int:
    """Runs of non-space characters that hold at least one letter."""
    return sum(any(c.isalpha() for c in piece) for piece in PIECE.findall(text))


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


class LimitCredit:
    """Per-token weights of the advantage for replies that went past a stated word limit."""

    def __init__(self, cfg: LimitCreditSettings, tokenizer: Any) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.patterns = [re.compile(p, re.IGNORECASE) for p in cfg.patterns]

    def stated_limit(self, sample: BatchSample) -> int | None:
        """The word limit said in the sample's hint, else the one the user said last in the
        conversation the reply answered (a limit, once said, holds for the session)."""
        if sample.hint is None:
            return None
        users = [m for m in sample.hint.messages if m.get("role") == "user"]
        texts = [sample.hint.text] + [_message_text(m) for m in reversed(users)]
        for text in texts:
            for pattern in self.patterns:
                found = pattern.search(text)
                if found and found.group(1).isdigit() and int(found.group(1)) > 0:
                    return int(found.group(1))
        return None

    def first_token_past(self, token_ids: Sequence[int], limit: int) -> int | None:
        """Index of the token that starts the reply's word number `limit + 1` (None: the
        reply stays within the limit). Prefix word counts never fall, so a bisection works."""
        low, high = 1, len(token_ids)
        if self._words(token_ids) <= limit:
            return None
        while low < high:  # the shortest prefix holding more than `limit` words
            mid = (low + high) // 2
            if self._words(token_ids[:mid]) > limit:
                high = mid
            else:
                low = mid + 1
        return low - 1

    def weights(self, sample: BatchSample) -> list[float] | None:
        """The sample's per-token advantage weights, or None where the credit does not apply."""
        if sample.advantage >= 0:
            return None
        limit = self.stated_limit(sample)
        if limit is None:
            return None
        cut = self.first_token_past(sample.completion_token_ids, limit)
        if cut is None:
            return None
        n = len(sample.completion_token_ids)
        return [self.cfg.within_weight] * cut + [1.0] * (n - cut)

    def for_batch(self, samples: Sequence[BatchSample]) -> dict[str, list[float]]:
        """Weights of every sample the credit applies to, by sample key."""
        found = {s.key: self.weights(s) for s in samples}
        return {key: w for key, w in found.items() if w is not None}

    def _words(self, token_ids: Sequence[int]) -> int:
        return count_words(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

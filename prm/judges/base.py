"""The judge plugin protocol: what a judge gets, what it returns, and how its output is checked.

A judge (`Judge`) has a `name`, an async `score(request)`, an `inline` flag and an async
`aclose()`; subclassing `JudgeBase` gives the defaults of the last two. The judging loop
builds one `JudgeRequest` per turn (the request messages, the assistant's response and the
next state that followed) and expects a `JudgeResult`, or None when the judge has no
opinion on this turn (for example the `feedback` judge when there is no explicit feedback).

Plugins are registered under the `liveloop.judges` entry-point group as a factory (usually
the class) that takes a `JudgeContext` and returns a judge. A factory may declare its own
settings as a pydantic model in `settings_model`: they are read from
`[prm.judge_args.<name>]` in TOML and `LIVELOOP_PRM__JUDGE_ARGS__<NAME>__<FIELD>` in the
environment, checked at start-up, and handed over in the context. A factory never sees the
rest of the configuration: no API key, no admin key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from liveloop import samples
from liveloop.config.prm import HINT_CHARS
from liveloop.contracts import Feedback, NextStateKind, TurnRecord, TurnType, turn_key

S = TypeVar("S", bound=BaseModel)


class JudgeError(RuntimeError):
    """A judge failed on one turn (raised, timed out or returned an invalid result)."""


@dataclass(frozen=True)
class JudgeContext:
    """What a judge factory receives: its own settings and the few shared values a judge needs.

    `settings` is the judge's `settings_model` filled from the configuration (None for a
    judge without one); `model` is the served model and `server_url` this LiveLoop
    server's OpenAI-compatible base URL (`.../v1`), for judges that ask it.
    """

    name: str
    settings: BaseModel | None = None
    model: str = ""
    server_url: str = ""
    data_dir: Path = Path(".liveloop")
    hint_chars: tuple[int, int] = HINT_CHARS  # (shortest non-trivial, longest kept) hint

    def settings_as(self, model: type[S]) -> S:
        """The judge's settings as `model` (its defaults when none were configured)."""
        if isinstance(self.settings, model):
            return self.settings
        raw = self.settings.model_dump() if self.settings is not None else {}
        return model.model_validate(raw)


@dataclass(frozen=True)
class NextState:
    """What followed a turn: the new messages of the next turn, explicit feedback, or nothing."""

    messages: list[dict[str, Any]] | None = None
    feedback: Feedback | None = None

    @property
    def signal(self) -> NextStateKind:
        """Which kind of signal this is; explicit feedback counts first."""
        if self.feedback is not None:
            return "feedback"
        if self.messages is not None:
            return "next_turn"
        return "timeout"


class TurnHead(BaseModel):
    """The parts of a turn record the judging loop itself reads (a cheap partial parse)."""

    model_config = ConfigDict(extra="ignore")

    session_id: str
    turn_index: int = Field(ge=0)
    sample_index: int = Field(0, ge=0)
    turn_type: TurnType = "main"
    messages: list[dict[str, Any]]
    response: dict[str, Any] = Field(default_factory=dict)
    versions: list[int] = Field(default_factory=list)
    tenant: str | None = None

    @property
    def key(self) -> str:
        """Same idempotency key as `TurnRecord.key`."""
        return turn_key(self.session_id, self.turn_index, self.sample_index)

    @property
    def min_version(self) -> int:
        """The oldest policy version that produced a token of this turn."""
        return samples.min_version(self)


class JudgeRequest:
    """Everything a judge may look at for one turn.

    `messages`, `response` and `next_state` are always there; `turn`, the full record with
    its token data, is parsed on first access (most judges never need it).
    """

    __slots__ = ("_raw", "_turn", "messages", "next_state", "response")

    def __init__(
        self,
        messages: list[dict[str, Any]],
        response: dict[str, Any],
        next_state: NextState,
        *,
        turn: TurnRecord | None = None,
        raw: str | None = None,
    ) -> None:
        if turn is None and raw is None:
            raise ValueError("a JudgeRequest needs the turn record or its raw JSON")
        self.messages = messages
        self.response = response
        self.next_state = next_state
        self._turn = turn
        self._raw = raw

    @classmethod
    def for_turn(cls, turn: TurnRecord, next_state: NextState) -> JudgeRequest:
        """A request for a parsed turn record."""
        return cls(turn.messages, turn.response, next_state, turn=turn)

    @property
    def turn(self) -> TurnRecord:
        """The whole turn record (session, token ids, log-probs, versions, timings)."""
        if self._turn is None:
            assert self._raw is not None
            self._turn = TurnRecord.model_validate_json(self._raw)
        return self._turn

    @property
    def signal(self) -> NextStateKind:
        """Shorthand for `next_state.signal`."""
        return self.next_state.signal


@dataclass
class JudgeResult:
    """A judge's verdict on one turn.

    `decisive` results replace the weighted combination of the other judges (explicit
    feedback wins over inferred signals); `votes` are the individual votes of a voting judge.
    `hint` explains the score; `directive_hint` is a short instruction saying what the reply
    should have done differently, when the next state reveals it ("Answer in one sentence."):
    the trainer's on-policy distillation puts it in front of a teacher.
    """

    score: float
    step_scores: list[float] | None = None
    hint: str | None = None
    votes: list[float] | None = None
    directive_hint: str | None = None
    decisive: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Judge(Protocol):
    """A process reward model: scores one turn from its request, response and next state.

    `inline` is True for a judge that never awaits I/O (the loop then skips the per-turn
    task it uses to overlap slow judges such as the LLM judge); `aclose()` is called at
    shutdown. `JudgeBase` provides both.
    """

    name: str
    inline: bool

    async def score(self, request: JudgeRequest) -> JudgeResult | None:
        """Score in [-1, 1] (plus optional extras), or None for no opinion on this turn."""
        ...

    async def aclose(self) -> None:
        """Release what the judge holds (clients, connections)."""
        ...


class JudgeBase:
    """A judge's defaults: not inline, nothing to close, no settings of its own.

    Subclasses set `name`, implement `score`, and may set `inline = True` or declare
    `settings_model` (a pydantic model of their settings, see `JudgeContext`).
    """

    name: str = "judge"
    inline: bool = False
    settings_model: ClassVar[type[BaseModel] | None] = None

    async def score(self, request: JudgeRequest) -> JudgeResult | None:
        """Score in [-1, 1] (plus optional extras), or None for no opinion on this turn."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Nothing to release by default."""
        return None


def _finite_in_range(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise JudgeError(f"{what} is not a number: {value!r}")
    number = float(value)
    if not math.isfinite(number) or not -1.0 <= number <= 1.0:
        raise JudgeError(f"{what} must be finite and within [-1, 1], got {number!r}")
    return number


def validate_result(judge_name: str, result: object) -> JudgeResult | None:
    """Check a judge's return value; anything malformed raises JudgeError."""
    if result is None:
        return None
    if not isinstance(result, JudgeResult):
        raise JudgeError(f"judge {judge_name!r} returned {type(result).__name__}, not JudgeResult")
    result.score = _finite_in_range(result.score, f"score of judge {judge_name!r}")
    for attr in ("step_scores", "votes"):
        values = getattr(result, attr)
        if values is not None:
            checked = [_finite_in_range(v, f"{attr} of judge {judge_name!r}") for v in values]
            setattr(result, attr, checked)
    for attr in ("hint", "directive_hint"):
        if getattr(result, attr) is not None and not isinstance(getattr(result, attr), str):
            raise JudgeError(f"{attr} of judge {judge_name!r} is not a string")
    return result


def clean_hint(text: str | None, min_chars: int, max_chars: int) -> str | None:
    """A directive hint with whitespace collapsed, or None when it is trivial.

    Shorter than `min_chars` ("ok", "n/a") is no hint; longer than `max_chars` is cut at a
    word boundary.
    """
    if not text:
        return None
    cleaned = " ".join(text.split())
    if len(cleaned) < min_chars:
        return None
    if len(cleaned) > max_chars:
        cut = cleaned[:max_chars].rsplit(" ", 1)[0]
        cleaned = cut if len(cut) >= min_chars else cleaned[:max_chars]
    return cleaned


def longest_hint(hints: list[str | None], min_chars: int, max_chars: int) -> str | None:
    """The longest non-trivial hint (the first of equal length), or None."""
    kept = [h for h in (clean_hint(t, min_chars, max_chars) for t in hints) if h]
    return max(kept, key=len) if kept else None


def message_text(message: dict[str, Any]) -> str:
    """The text of a chat message (string content or the text parts of a content list)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "\n".join(p for p in parts if isinstance(p, str))
    return ""

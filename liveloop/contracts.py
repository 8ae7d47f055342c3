"""Versioned stream contracts: what each loop writes and the next one reads.

Every stream entry has a field `data` holding one JSON object (one of the models below),
readable with a plain XRANGE. Bump SCHEMA_VERSION on an incompatible change.
"""

from __future__ import annotations

import json
import time
from enum import StrEnum
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from liveloop import samples

SCHEMA_VERSION = 1

TurnType = Literal["main", "side"]
"""'main': part of the conversation, trained on; 'side': a title, a summary, never trained on."""
TURN_TYPES: tuple[TurnType, ...] = get_args(TurnType)

TOOL_ROLES = frozenset({"tool", "function", "ipython"})
"""Roles of the messages that carry a tool's result back (OpenAI's, its legacy one, Llama's)."""


class VersionStatus(StrEnum):
    """Where a policy version stands: the trainer records it, the registry keeps it, the
    weights announcement carries it, the servers obey it."""

    ACCEPTED = "accepted"  # passed the promotion gate (or there is none): servable
    REJECTED = "rejected"  # refused by the promotion gate: never served
    ROLLED_BACK = "rolled_back"  # served, then judged worse by the served-quality watch

    @property
    def servable(self) -> bool:
        """True for a version servers may load."""
        return self is VersionStatus.ACCEPTED


def parse_turn_type(value: str | None) -> TurnType:
    """A turn type from its text (case and spaces ignored; None is 'main'); ValueError else."""
    text = (value or "main").strip().lower()
    for turn_type in TURN_TYPES:
        if text == turn_type:
            return turn_type
    raise ValueError(f"must be {' or '.join(TURN_TYPES)}")


def turn_key(session_id: str, turn_index: int | str, sample_index: int) -> str:
    """Idempotency key of one sample of one turn: `session:turn:sample`.

    (A `str` index is a placeholder, for key templates the pairing scripts fill in.)
    """
    return f"{session_id}:{turn_index}:{sample_index}"


def group_key(session_id: str, turn_index: int | str) -> str:
    """Key shared by the samples answering one prompt: `session:turn`."""
    return f"{session_id}:{turn_index}"


def call_arguments_value(arguments: Any) -> Any:
    """A tool call's arguments by value (an OpenAI message carries them as a JSON string):
    clients echo them re-serialized (LangChain dumps the dict it parsed), so `{\n "city":
    "Oslo"\n}` as sampled and `{"city": "Oslo"}` are one call. A string that is not JSON
    stays as it is."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


class Contract(BaseModel):
    """Base of every stream payload; unknown fields are kept so newer writers don't break readers."""

    model_config = ConfigDict(extra="allow")

    schema_version: int = SCHEMA_VERSION


class TurnTimings(BaseModel):
    """Latencies of one turn, in seconds."""

    queued_s: float = 0.0
    time_to_first_token_s: float = 0.0
    total_s: float = 0.0


class TurnRecord(Contract):
    """One assistant turn as served, token-exact. Written by the server to `liveloop:turns`."""

    session_id: str
    turn_index: int = Field(ge=0, description="0 for a session's first assistant turn.")
    turn_type: TurnType = "main"
    tenant: str
    request_id: str
    sample_index: int = Field(0, ge=0, description="Which of the request's n samples this is.")
    messages: list[dict[str, Any]] = Field(description="The request's messages.")
    tools: list[dict[str, Any]] | None = None
    response: dict[str, Any] = Field(
        default_factory=dict, description="The assistant message returned (content, tool_calls)."
    )
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float] = Field(description="Behaviour log-prob of each completion token.")
    versions: list[int] = Field(description="Policy version that produced each completion token.")
    adapter: str | None = Field(
        None,
        description="The LoRA adapter that served the turn (its versions are `versions`); "
        "None: the base weights.",
    )
    finish_reason: str
    model: str
    prompt_mode: Literal["fresh", "extended"] = Field(
        "fresh",
        description="'extended': prompt = previous prompt + completion + new message ids.",
    )
    created_at: float = Field(default_factory=time.time)
    timings: TurnTimings = Field(default_factory=TurnTimings)

    @property
    def key(self) -> str:
        """Idempotency key: a turn (and sample) is identified by session, index and sample."""
        return turn_key(self.session_id, self.turn_index, self.sample_index)

    @property
    def group_key(self) -> str:
        """Samples answering the same prompt share this key (for group-normalised advantages)."""
        return group_key(self.session_id, self.turn_index)

    @property
    def min_version(self) -> int:
        """The oldest policy version that produced a token of this turn."""
        return samples.min_version(self)

    @property
    def num_tokens(self) -> int:
        """Prompt + completion tokens."""
        return samples.num_tokens(self)


NextStateKind = Literal["next_turn", "feedback", "timeout"]
"""What a turn was judged on: the next turn's new messages, explicit feedback, or nothing."""


class ScoredTurn(TurnRecord):
    """A judged turn, written by the judging loop to `liveloop:scored`: the turn plus its score."""

    score: float = Field(ge=-1.0, le=1.0)
    judge: str
    signal: NextStateKind = "next_turn"
    step_scores: list[float] | None = None
    hint: str | None = Field(None, description="A judge's explanation of its score (free text).")
    directive_hint: str | None = Field(
        None,
        description="What the reply should have done differently, as a short instruction "
        "('Answer in 20 words at most.'), when the next state revealed it; used by OPD.",
    )
    votes: list[float] | None = None
    judged_at: float = Field(default_factory=time.time)


class Feedback(Contract):
    """Explicit feedback on a turn, written by `POST /v1/feedback` to `liveloop:feedback`."""

    session_id: str
    turn_index: int = Field(ge=0)
    score: float = Field(ge=-1.0, le=1.0)
    comment: str | None = None
    tenant: str
    created_at: float = Field(default_factory=time.time)


class SampleHint(BaseModel):
    """A directive hint with the conversation it applies to, for the OPD teacher.

    The trainer inserts `text` into the sample's own prompt ids as the chat template renders
    an extra instruction before the assistant's reply; `messages` and `tools` are the turn's
    request, needed to check that the insertion is exact.
    """

    text: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


class BatchSample(BaseModel):
    """One training sample: token-exact ids, behaviour log-probs and its advantage."""

    key: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    advantage: float
    score: float
    hint: SampleHint | None = Field(
        None, description="The judge's directive hint (only on turns that have one)."
    )

    @property
    def min_version(self) -> int:
        """The oldest policy version that produced a token of this sample."""
        return samples.min_version(self)

    @property
    def num_tokens(self) -> int:
        """Prompt + completion tokens."""
        return samples.num_tokens(self)


class TrainingBatch(Contract):
    """A packed batch in `liveloop:batches`; `samples` inline, or in the file at `path`."""

    batch_id: str
    created_at: float = Field(default_factory=time.time)
    trainer_version: int = Field(
        description="Policy version the collector bounded staleness against."
    )
    num_tokens: int
    samples: list[BatchSample] | None = None
    path: str | None = None
    tenant: str | None = Field(
        None, description="In tenant scope, the one tenant whose turns the batch holds."
    )


class WeightsAnnouncement(Contract):
    """A new policy version, announced by the trainer on `liveloop:weights`."""

    version: int = Field(ge=0)
    path: str = Field(description="Directory of a safetensors checkpoint from_pretrained can load.")
    parent: int | None = None
    created_at: float = Field(default_factory=time.time)
    metrics: dict[str, float] = Field(default_factory=dict)
    status: VersionStatus = Field(
        VersionStatus.ACCEPTED,
        description="'rejected': the promotion gate refused this version; it is never served.",
    )
    reason: str | None = Field(None, description="Why a rejected version was refused.")
    kind: Literal["full", "adapter"] = Field(
        "full",
        description="'full': `path` holds whole model weights; 'adapter': a LoRA adapter in "
        "the PEFT layout, served over the unchanged base model.",
    )
    adapter: str | None = Field(
        None, description="The adapter's name (kind 'adapter'); its versions are this field's."
    )
    tenant: str | None = Field(
        None, description="The tenant whose adapter this is (tenant scope); None: shared."
    )
    withdrawn: bool = Field(
        False,
        description="Not a version: the adapter named is withdrawn (its tenant was deleted); "
        "every server stops serving it and routes the tenant to the shared adapter or the base.",
    )

    @property
    def servable(self) -> bool:
        """True for a version servers may load (every accepted one; never a withdrawal)."""
        return self.status.servable and not self.withdrawn

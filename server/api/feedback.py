"""`POST /v1/feedback`: explicit feedback on a turn, published to `liveloop:feedback`.

Only the tenant that owns a session may rate its turns; the judging loop reads the stream.
"""

from __future__ import annotations

import logging

import redis
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from liveloop import bus
from liveloop.contracts import Feedback
from liveloop.server.api.deps import StateDep, TenantDep
from liveloop.server.api.errors import APIError, error_responses
from liveloop.server.state import ServerState

log = logging.getLogger(__name__)

router = APIRouter(tags=["feedback"])


class FeedbackRequest(BaseModel):
    """Feedback on one assistant turn of a session."""

    model_config = ConfigDict(extra="forbid")

    session_id: str = Field(min_length=1, max_length=128)
    turn_index: int | None = Field(None, ge=0, description="Default: the session's latest turn.")
    score: float = Field(ge=-1.0, le=1.0, allow_inf_nan=False)
    comment: str | None = Field(None, max_length=10_000)


class FeedbackResponse(BaseModel):
    """The accepted feedback and its stream entry id."""

    object: str = "feedback"
    id: str | None
    session_id: str
    turn_index: int
    score: float


async def _owner(state: ServerState, session_id: str) -> tuple[str | None, int]:
    try:
        owner, turns = await state.sessions.owner(session_id)
    except (redis.RedisError, OSError) as exc:
        raise APIError(503, f"session store unavailable: {exc}", code="redis_unavailable") from None
    return owner, int(turns)


@router.post(
    "/v1/feedback",
    response_model=FeedbackResponse,
    responses=error_responses(400, 401, 403, 404, 503),
)
async def post_feedback(
    body: FeedbackRequest, tenant: TenantDep, state: StateDep
) -> FeedbackResponse:
    """Record a score in [-1, 1] for a turn of one of the caller's sessions."""
    owner, turns = await _owner(state, body.session_id)
    if owner is None or turns == 0:
        raise APIError(
            404,
            f"session {body.session_id!r} not found",
            param="session_id",
            code="session_not_found",
        )
    if owner != tenant:
        raise APIError(
            403,
            f"session {body.session_id!r} belongs to another tenant",
            param="session_id",
            code="session_forbidden",
        )
    turn_index = turns - 1 if body.turn_index is None else body.turn_index
    if turn_index >= turns:
        raise APIError(
            404,
            f"session {body.session_id!r} has no turn {turn_index} (it has {turns})",
            param="turn_index",
            code="turn_not_found",
        )
    feedback = Feedback(
        session_id=body.session_id,
        turn_index=turn_index,
        score=body.score,
        comment=body.comment,
        tenant=tenant,
    )
    try:
        entry = await bus.publish(
            state.redis, bus.FEEDBACK, feedback, session_id=body.session_id, turn_index=turn_index
        )
    except (redis.RedisError, OSError) as exc:
        raise APIError(503, f"cannot record feedback: {exc}", code="redis_unavailable") from None
    return FeedbackResponse(
        id=entry, session_id=body.session_id, turn_index=turn_index, score=body.score
    )

"""Admin routes (admin key only): weights served and loaded, trace capture on/off."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from liveloop.server.api.deps import AdminDep, StateDep
from liveloop.server.api.errors import APIError, error_responses
from liveloop.weights import CheckpointError

router = APIRouter(
    prefix="/admin",
    tags=["admin"],
    dependencies=[AdminDep],
    responses=error_responses(400, 401, 403, 503),
)


class LoadWeightsRequest(BaseModel):
    """A checkpoint directory to load, and the policy version to serve it as."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, max_length=4096)
    version: int | None = Field(None, ge=0)


@router.get("/weights")
async def get_weights(state: StateDep) -> dict[str, Any]:
    """The policy version served, the versions served before, and those refused.

    `refused`: checkpoints this server could not load (the latest 100; `refusals` counts
    all since start); `rejected`: versions the promotion gate refused (never served). The
    engine's view comes with it (with SGLang: each replica's version and state).
    """
    follower = state.follower
    return {
        "version": int(state.engine.version),
        "history": list(follower.history),
        "refusals": follower.refusals,
        "refused": list(follower.refused),
        "rejected": list(follower.rejected),
        **state.engine.health(),
    }


@router.post("/weights")
async def load_weights(body: LoadWeightsRequest, state: StateDep) -> dict[str, Any]:
    """Load a checkpoint and swap it in; a bad one is refused (400) and serving goes on."""
    try:
        version = await state.follower.load(body.path, body.version, allow_rollback=True)
    except CheckpointError as exc:
        raise APIError(
            400, f"checkpoint refused: {exc}", param="path", code="invalid_checkpoint"
        ) from None
    return {"version": int(version), "history": list(state.follower.history)}


@router.get("/capture")
async def get_capture(state: StateDep) -> dict[str, bool]:
    """Whether turns are being recorded."""
    return {"capture": state.capture}


@router.post("/capture/pause")
async def pause_capture(state: StateDep) -> dict[str, bool]:
    """Stop recording turns (requests are still served)."""
    state.capture = False
    return {"capture": False}


@router.post("/capture/resume")
async def resume_capture(state: StateDep) -> dict[str, bool]:
    """Record turns again."""
    state.capture = True
    return {"capture": True}

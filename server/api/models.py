"""`GET /v1/models`: the one model this server serves (under its name; its alias is accepted too)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from liveloop.server.api.auth import tenant_auth
from liveloop.server.api.deps import StateDep
from liveloop.server.api.errors import APIError
from liveloop.server.state import ServerState

router = APIRouter(tags=["models"], dependencies=[Depends(tenant_auth)])


def _card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "liveloop",
        "max_model_len": int(state.engine.max_model_len),
        "policy_version": int(state.engine.version),
    }


@router.get("/v1/models")
async def list_models(state: StateDep) -> dict[str, Any]:
    """The served model."""
    return {"object": "list", "data": [_card(state)]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, state: StateDep) -> dict[str, Any]:
    """One model by name or alias; 404 for any other name."""
    if model_id not in state.chat.model_aliases:
        raise APIError(
            404, f"model {model_id!r} does not exist", param="model", code="model_not_found"
        )
    return _card(state)

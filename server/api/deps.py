"""Shared FastAPI dependencies: the server state owned by the app's lifespan."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request

from liveloop.server.api.errors import APIError

if TYPE_CHECKING:
    from liveloop.server.app import ServerState


def get_state(request: Request) -> ServerState:
    """The running server's state; 503 while it is still starting or already stopping."""
    state: ServerState = request.app.state.liveloop
    if not state.ready:
        raise APIError(503, "the server is not ready yet", code="not_ready")
    return state

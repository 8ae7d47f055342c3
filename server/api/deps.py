"""The routes' dependencies (async: FastAPI runs a plain `def` dependency in its thread pool), as `Annotated` types: the server state, the tenant, the admin.

    async def route(state: StateDep, tenant: TenantDep) -> ...

`StateDep` is the running server's state (503 while it starts or stops); `TenantDep` the
caller's tenant (401 on a missing or wrong API key); `AdminDep` checks the admin key.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from liveloop.server.api.auth import admin_auth, tenant_auth
from liveloop.server.api.errors import APIError
from liveloop.server.state import ServerState


async def app_state(request: Request) -> ServerState:
    """The server state the app was built with, ready or not (health probes, metrics)."""
    state: ServerState = request.app.state.liveloop
    return state


async def ready_state(request: Request) -> ServerState:
    """The running server's state; 503 while it is still starting or already stopping."""
    state: ServerState = request.app.state.liveloop
    if not state.ready:
        raise APIError(503, "the server is not ready yet", code="not_ready")
    return state


AppStateDep = Annotated[ServerState, Depends(app_state)]
StateDep = Annotated[ServerState, Depends(ready_state)]
TenantDep = Annotated[str, Depends(tenant_auth)]
AdminDep = Depends(admin_auth)

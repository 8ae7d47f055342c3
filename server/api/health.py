"""Liveness, readiness and Prometheus metrics endpoints (no auth: for probes and scrapers)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from liveloop.server.api.deps import AppStateDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(state: AppStateDep) -> Response:
    """200 once the engine serves requests; 503 before that, while stopping, and while the
    engine cannot serve (worker down, no SGLang replica in the pool). Engine details
    (the SGLang replicas) come with it."""
    engine_down = state.ready and not state.engine.is_running
    ready = state.ready and not engine_down
    body: dict[str, Any] = {
        "status": "ready" if ready else "engine down" if engine_down else "starting"
    }
    if ready:
        body["policy_version"] = int(state.engine.version)
        body["model"] = state.model_name
        body["trace_capture"] = state.capture
    if state.ready:
        body.update(state.engine.health())
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(state: AppStateDep) -> Response:
    """Prometheus exposition of the server's metrics."""
    return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

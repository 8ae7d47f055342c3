"""Admin routes (admin key only): weights served and loaded, trace capture on/off, and a
tenant's deletion."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from liveloop import bus
from liveloop.contracts import VersionStatus, WeightsAnnouncement
from liveloop.server.api.deps import AdminDep, StateDep
from liveloop.server.api.errors import APIError, error_responses
from liveloop.tenant_removal import TenantRemoval
from liveloop.tenants import valid_tenant
from liveloop.weights import CheckpointError

router = APIRouter(
    prefix="/admin",
    tags=["admin"],
    dependencies=[AdminDep],
    responses=error_responses(400, 401, 403, 503),
)


class LoadWeightsRequest(BaseModel):
    """A checkpoint directory to load, and the policy version to serve it as; with
    `adapter`, a LoRA adapter directory to serve as that adapter's version (others stay)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, max_length=4096)
    version: int | None = Field(None, ge=0)
    adapter: str | None = Field(None, min_length=1, max_length=256)
    tenant: str | None = Field(
        None, max_length=256, description="Whose adapter it is (route their requests to it)."
    )


@router.get("/weights")
async def get_weights(state: StateDep) -> dict[str, Any]:
    """The policy version served, the versions served before, and those refused.

    `refused`: checkpoints this server could not load (the latest 100; `refusals` counts
    all since start); `rejected`: versions the promotion gate refused (never served). The
    engine's view comes with it (with SGLang: each replica's version and state).
    """
    follower = state.follower
    routing = follower.routing
    return {
        "version": int(state.engine.version),
        "adapters": {
            name: {
                "version": version,
                "shared": name == routing.shared,
                "tenants": sorted(t for t, a in routing.by_tenant.items() if a == name),
            }
            for name, version in sorted(state.engine.adapters().items())
        },
        "history": list(follower.history),
        "refusals": follower.refusals,
        "refused": list(follower.refused),
        "rejected": list(follower.rejected),
        **state.engine.health(),
    }


@router.post("/weights")
async def load_weights(body: LoadWeightsRequest, state: StateDep) -> dict[str, Any]:
    """Load a checkpoint and swap it in, or (with `adapter`) one adapter version, an older
    one too (a rollback of that adapter alone); a bad one is refused (400) and serving goes
    on."""
    try:
        if body.adapter is not None:
            if body.version is None:
                raise APIError(400, "an adapter needs its version", param="version")
            version = await state.follower.load_adapter(
                body.adapter, body.path, body.version, tenant=body.tenant, allow_rollback=True
            )
        else:
            version = await state.follower.load(body.path, body.version, allow_rollback=True)
    except CheckpointError as exc:
        raise APIError(
            400, f"checkpoint refused: {exc}", param="path", code="invalid_checkpoint"
        ) from None
    return {"version": int(version), "history": list(state.follower.history)}


@router.delete("/adapters/{name}")
async def unload_adapter(name: str, state: StateDep) -> dict[str, Any]:
    """Stop serving an adapter (its requests go to the shared adapter or the base model);
    requests already running on it finish on it. Unknown: 404."""
    if name not in state.engine.adapters():
        raise APIError(404, f"no adapter {name!r} is served", param="name", code="not_found")
    await state.follower.unload_adapter(name)
    return {"adapters": state.engine.adapters()}


@router.delete("/tenants/{key_id}", responses=error_responses(404))
async def delete_tenant(key_id: str, state: StateDep) -> dict[str, Any]:
    """Forget a tenant (an API key id): stop serving its adapters, and remove its turns,
    judged turns, batches, sessions, checkpoints, registry rows and archived records
    (`liveloop.tenant_removal`). A tenant with neither a configured key nor anything left
    is a 404; deleting one again removes nothing and answers the same way."""
    if not valid_tenant(key_id):
        raise APIError(404, f"no tenant {key_id!r}", param="key_id", code="not_found")
    served = state.engine.adapters()
    adapters = {a for a in (state.follower.routing.by_tenant.get(key_id), key_id) if a in served}
    known = key_id in state.auth.tenants or bool(adapters)
    for name in sorted(adapters):
        await state.follower.withdraw(name, key_id)
    state.follower.routing.forget_tenant(key_id)
    removal = TenantRemoval(
        state.redis,
        checkpoints_dir=state.shared.checkpoints_dir,
        data_dir=state.shared.data_dir,
        archive_dir=state.archive_dir,
        db_url=state.shared.effective_db_url,
    )
    report = await removal.remove(key_id)
    for name in sorted(adapters | {key_id}):  # every other server unloads it too
        withdrawal = WeightsAnnouncement(version=0, path="", kind="adapter", adapter=name,
                                         tenant=key_id, withdrawn=True,
                                         status=VersionStatus.REJECTED, reason="tenant deleted")  # fmt: skip
        await bus.publish(state.redis, bus.WEIGHTS, withdrawal)
    if not known and not report.found:
        raise APIError(404, f"no tenant {key_id!r}", param="key_id", code="not_found")
    return {"tenant": key_id, "adapters_unloaded": sorted(adapters), **dataclasses.asdict(report)}


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

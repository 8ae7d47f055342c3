"""Held-out users against chosen policy versions: `liveloop eval --version` and the demo's end.

A held-out population (a different seed, never recorded) is the demo's fair test: the
server is made to serve one version (`load_version`), the users talk to it, and their own
ratings and the quality of the replies are the version's held-out figures. The demo does it
for version 0 and its final version after training is frozen (`compare_versions`);
`liveloop eval --version V` does it for one version on a server of its own (`run_eval`).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import time
from typing import Any

import httpx

from liveloop import bus
from liveloop.config import LiveLoopSettings
from liveloop.config.defaults import model_defaults
from liveloop.demo.examples import hint_examples
from liveloop.demo.measures import reply_quality
from liveloop.demo.preferences import WordLimit, make_population
from liveloop.demo.report import JudgedTurn
from liveloop.demo.tool_probe import tool_call_rate
from liveloop.demo.users import UserRun, UserStats, run_population
from liveloop.supervisor import Supervisor
from liveloop.valkey import free_port
from liveloop.weights import adapter_name_of, latest_announcement_sync

EVAL_USERS = 6  # held-out users per evaluation
EVAL_TURNS_PER_USER = 4  # answers each of them rates


class DemoError(RuntimeError):
    """The demo or an evaluation could not run (no server became ready, a version would not load)."""


def wait_ready(base_url: str, supervisor: Supervisor, timeout_s: float = 300.0) -> None:
    """Block until the server answers /readyz, or fail if it keeps crashing."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        supervisor.check()
        time.sleep(0.5)
    raise DemoError(f"server at {base_url} not ready after {timeout_s:.0f}s; see logs")


def load_version(base_url: str, admin_key: str, path: str, version: int) -> None:
    """Make the server serve the checkpoint at `path` as `version`: full weights (every
    adapter unloaded, so that version 0 is the base model), or a version published as a
    LoRA adapter, which then serves every request."""
    auth = {"Authorization": f"Bearer {admin_key}"}
    adapter = adapter_name_of(path)
    if adapter is None:
        served = httpx.get(base_url + "/admin/weights", headers=auth, timeout=30).json()
        for name in served.get("adapters") or {}:
            httpx.delete(f"{base_url}/admin/adapters/{name}", headers=auth, timeout=60)
    body = {"path": path, "version": version, **({"adapter": adapter} if adapter else {})}
    resp = httpx.post(base_url + "/admin/weights", json=body, headers=auth, timeout=300)
    if resp.status_code != 200:
        raise DemoError(f"loading version {version} failed: {resp.status_code} {resp.text[:200]}")


def held_out_reward(stats: UserStats) -> dict[str, Any]:
    """Held-out users' own ratings (+1 pleased, 0 lukewarm, -1 not) and their replies' quality."""
    turns = sorted(stats.turns, key=lambda t: (t.user, t.at))
    scores = [t.rating for t in turns]
    return {
        "turns": len(scores),
        "mean_reward": sum(scores) / len(scores) if scores else None,
        **reply_quality((t.question, t.reply) for t in turns),
        "replies": [
            {
                "user": t.user,
                "question": t.question,
                "reply": t.reply,
                "reaction": t.reaction,
                "rating": t.rating,
            }
            for t in turns
        ],
    }


def evaluate(
    base_url: str, model: str, seed: int, weather_share: float | None = None, retries: int = 0
) -> dict[str, Any]:
    """Held-out simulated users (a different seed) against whatever the server serves now
    (`retries`: as `demo.retries_after_complaint`)."""
    defaults = model_defaults(model)
    people = make_population(
        EVAL_USERS,
        seed + 10_000,
        defaults.word_limits,
        strict=defaults.has_language,
        weather_share=weather_share,
    )
    return evaluate_people(base_url, model, people, seed, retries=retries)


def evaluate_people(
    base_url: str,
    model: str,
    people: list[WordLimit],
    seed: int,
    api_key: str = "none",
    turns_per_user: int = EVAL_TURNS_PER_USER,
    retries: int = 0,
) -> dict[str, Any]:
    """These held-out users (seeded apart from the demo's), with this API key, against what
    the server serves that key now; nothing they say is recorded. Their requests' sampling
    is seeded too: two versions are compared on the same draws, and an unchanged policy
    mostly gets the same replies again (batched arithmetic can tip a near-tie token)."""
    max_tokens = model_defaults(model).reply_tokens
    run = UserRun(
        base_url=base_url,
        model=model,
        max_tokens=max_tokens,
        record=False,
        api_key=api_key,
        sample_seed=seed + 10_000,
        retries=retries,
    )
    stats = asyncio.run(
        run_population(
            run, people, seconds=600, seed=seed + 10_000, max_turns_per_user=turns_per_user
        )
    )
    return held_out_reward(stats)


def latest_checkpoint(redis_url: str) -> tuple[int, str] | None:
    """The newest accepted version and its checkpoint path (None before the first update)."""
    client = bus.redis_client_sync(redis_url)
    try:
        latest = latest_announcement_sync(client, scan=64)  # never a version the gate refused
    finally:
        client.close()
    return (latest.version, latest.path) if latest is not None else None


def compare_versions(
    supervisor: Supervisor,
    admin_key: str,
    base_dir: str,
    settings: LiveLoopSettings,
    turns: list[JudgedTurn],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Freeze training, then held-out users on version 0 and on the final version.

    With the final version loaded, a few hinted turns are asked again (not recorded), to
    show each hint with the reply that earned it and the final version's reply.
    """
    supervisor.stop_loops(("judge", "collect", "train"))  # no announcement may follow a rollback
    latest = latest_checkpoint(supervisor.redis_url)
    result: dict[str, Any] = {}
    candidates = [("version 0", 0, base_dir)]
    if latest is not None:
        candidates.append((f"version {latest[0]} (final)", latest[0], latest[1]))
    examples: list[dict[str, Any]] = []
    for label, version, path in candidates:
        load_version(supervisor.base_url, admin_key, path, version)
        result[label] = evaluate(
            supervisor.base_url,
            settings.model,
            settings.demo.seed,
            settings.demo.weather_share,
            settings.demo.retries_after_complaint,
        )
        probes = settings.demo.tool_probes if settings.demo.weather_share != 0 else 0
        if probes:
            result[label]["tool_probe"] = tool_call_rate(
                supervisor.base_url, settings.model, probes, settings.demo.seed
            )
        if version == candidates[-1][1]:
            examples = hint_examples(supervisor.base_url, settings.model, turns, version)
    return result, examples


def run_eval(settings: LiveLoopSettings, *, version: int | None) -> None:
    """Held-out users against one policy version (default: the latest; 0 = the base model)."""
    from liveloop.models import resolve_model_dir
    from liveloop.registry import Registry

    registry = Registry.open(settings.effective_db_url)
    try:
        if version is None:
            info = registry.latest_model_version()
        else:
            info = registry.get_model_version(version) if version > 0 else None
    finally:
        registry.close()
    if version and info is None:
        raise DemoError(f"policy version {version} is not in the registry")
    path = info.path if info else str(resolve_model_dir(settings.model))
    chosen = info.version if info else 0
    admin_key = secrets.token_urlsafe(16)
    scratch = settings.data_dir / "eval"
    shutil.rmtree(scratch, ignore_errors=True)
    child = settings.model_copy(
        update={"data_dir": scratch, "port": free_port(), "redis_url": None}
    )
    supervisor = Supervisor(child, loops=("serve",), extra_env={"LIVELOOP_ADMIN_KEY": admin_key})
    supervisor.start()
    try:
        wait_ready(supervisor.base_url, supervisor)
        if chosen:
            load_version(supervisor.base_url, admin_key, path, chosen)
        result = evaluate(
            supervisor.base_url,
            settings.model,
            settings.demo.seed,
            settings.demo.weather_share,
            settings.demo.retries_after_complaint,
        )
    finally:
        supervisor.stop()
    print(json.dumps({"version": chosen, "path": path, **result}, indent=2))

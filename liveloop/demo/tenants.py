"""`liveloop demo --tenants N`: personal adapters against one shared policy, side by side.

Tenants with conflicting house styles (`liveloop.demo.styles`), each with its own API key,
talk to one base model. The demo runs the four loops once per trainer scope (`demo.scopes`:
'tenant', an adapter per tenant learned from that tenant's judged turns alone; 'shared', one
policy learned from everyone's), for the same minutes with the same tenants and users. After
each run, training frozen, every tenant's held-out users (never recorded) rate what that
tenant is served now and what the base model serves, every tenant is asked the same few
questions at temperature 0, and the streams are read back for isolation: no tenant's turn
was served by another tenant's adapter, and no batch mixed tenants. The report's matrix
(`liveloop.demo.tenant_report`) puts each tenant's gain in both scopes side by side.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import httpx

from liveloop import bus
from liveloop.config import LiveLoopSettings
from liveloop.config.defaults import model_defaults
from liveloop.contracts import TrainingBatch
from liveloop.demo.driving import drive
from liveloop.demo.heldout import (
    EVAL_TURNS_PER_USER,
    EVAL_USERS,
    DemoError,
    evaluate_people,
    load_version,
    wait_ready,
)
from liveloop.demo.measures import user_reactions
from liveloop.demo.report import JudgedTurn, headline, read_judged, summarise
from liveloop.demo.styles import Tenant, house_style, make_tenants
from liveloop.demo.tenant_report import ScopeRun, write_tenant_report
from liveloop.demo.users import WEATHER_TOOL, UserRun
from liveloop.supervisor import Supervisor
from liveloop.tenants import tenant_id

log = logging.getLogger(__name__)

SAME_QUESTIONS = ("Tell me about bread.", "What should I know about the moon?")
# Held-out users per tenant and version, and the answers each rates: as many answers (24) as
# the one-tenant demo's, so that one reply moves a quality share by less than the checks'
# slack (with 12, a single reply off topic failed the topic check).
HELD_OUT_USERS = EVAL_USERS
HELD_OUT_TURNS = EVAL_TURNS_PER_USER


def run_tenant_demo(
    settings: LiveLoopSettings, *, config_files: list[Path] | None = None, quiet: bool = False
) -> None:
    """Every scope of `demo.scopes` in turn with the same tenants, then the matrix report."""
    if not settings.trainer.lora.enabled:
        raise DemoError(
            "the tenants demo trains an adapter per tenant: set trainer.lora.enabled = true "
            "(the 'tenants' preset does)"
        )
    defaults = model_defaults(settings.model)
    demo = settings.demo
    tenants = make_tenants(
        demo.tenants,
        demo.users,
        strict=defaults.has_language,
        brief_words=demo.brief_words,
        users_per_style={style: n for style, n in demo.users_per_style.items()},
    )
    out_dir = settings.data_dir / "demo"
    bases: dict[str, dict[str, Any]] = {}  # each tenant's held-out figures of the base model
    runs = [
        run_scope(settings, scope, tenants, out_dir / f"run-{scope}", config_files, quiet, bases)
        for scope in dict.fromkeys(demo.scopes)
    ]
    paths = write_tenant_report(out_dir, settings, tenants, runs)
    print(f"demo report: {paths['md']}\n             {paths['json']}")
    for run in runs:
        for label, figures in run.tenants.items():
            print(
                f"{run.scope} scope, {label}: reward {figures['reward_first_window']} -> "
                f"{figures['reward_last_window']} ({figures['turns']} judged turns)"
            )


def run_scope(
    settings: LiveLoopSettings,
    scope: str,
    tenants: list[Tenant],
    run_dir: Path,
    config_files: list[Path] | None,
    quiet: bool,
    bases: dict[str, dict[str, Any]],
) -> ScopeRun:
    """The loops in `scope`, every tenant's users side by side, then the per-tenant figures.

    The base model's held-out figures are the same in every scope (the same model, users and
    seeds), so a scope after the first reuses those in `bases` and measures only its finals:
    both scopes' checks then compare with one measure of the base.
    """
    from liveloop.models import resolve_model_dir
    from liveloop.status import LiveView

    shutil.rmtree(run_dir, ignore_errors=True)
    child = settings.model_copy(update={"data_dir": run_dir, "db_url": None})
    base_dir = str(resolve_model_dir(settings.model))
    admin_key = secrets.token_urlsafe(16)
    demo = settings.demo
    env = _scope_env(settings, scope, tenants, admin_key)
    supervisor = Supervisor(child, config_files=config_files, extra_env=env)
    reply_tokens = model_defaults(settings.model).reply_tokens
    supervisor.start()
    try:
        wait_ready(supervisor.base_url, supervisor)
        groups = [
            (
                UserRun(
                    supervisor.base_url,
                    settings.model,
                    t.api_key,
                    max_tokens=reply_tokens,
                    retries=demo.retries_after_complaint,
                    sample_seed=demo.live_sample_seed(t.index),
                ),
                t.people,
            )
            for t in tenants
        ]
        with LiveView(supervisor, quiet=quiet, title=f"LiveLoop tenants demo ({scope})") as view:
            seen = drive(groups, demo.minutes * 60, demo.seed, supervisor, view,
                         turns_per_update=demo.turns_per_update)  # fmt: skip
        time.sleep(3.0)  # let the judge score the last replies
        supervisor.stop_loops(("judge", "collect", "train"))  # training frozen from here
        turns = read_judged(supervisor.redis_url)
        run = ScopeRun(scope, judged_turns=len(turns))
        run.isolation = isolation_checks(supervisor.redis_url, run_dir, turns, tenants, scope)
        run.served_versions = len({(t.adapter, t.version) for t in turns})
        finals = {t.label: _served_now(supervisor.base_url, settings, t) for t in tenants}
        unmeasured = [t for t in tenants if t.label not in bases]
        if unmeasured:  # the base served (every adapter unloaded) only to be measured
            load_version(supervisor.base_url, admin_key, base_dir, 0)
            bases.update({t.label: _held_out(supervisor.base_url, settings, t) for t in unmeasured})
        for tenant, stats in zip(tenants, seen, strict=True):
            mine = [t for t in turns if t.tenant == _tenant_id(tenant)]
            figures = tenant_figures(mine, settings, bases[tenant.label], finals[tenant.label])
            figures["reactions"] = user_reactions(stats.turns, demo.window_turns, stats.tool_asks)
            run.tenants[tenant.label] = figures
    finally:
        supervisor.stop()
    return run


def _scope_env(
    settings: LiveLoopSettings, scope: str, tenants: list[Tenant], admin_key: str
) -> dict[str, str]:
    """The loops' environment for one scope: the tenants' keys, the scope, the objective."""
    demo = settings.demo
    env = {
        "LIVELOOP_ADMIN_KEY": admin_key,
        "LIVELOOP_API_KEYS": ",".join(t.api_key for t in tenants),
        "LIVELOOP_TRAINER__SCOPE": scope,
        "LIVELOOP_TRAINER__OBJECTIVE": demo.objectives[0],
    }
    if demo.turns_per_update:
        env["LIVELOOP_COLLECTOR__MIN_TURNS"] = str(demo.turns_per_update)
    return env


def _tenant_id(tenant: Tenant) -> str:
    return tenant_id(tenant.api_key)


def _held_out(base_url: str, settings: LiveLoopSettings, tenant: Tenant) -> dict[str, Any]:
    """The tenant's held-out users (its house style) against what it is served now."""
    strict = model_defaults(settings.model).has_language
    brief = settings.demo.brief_words
    people = [house_style(tenant.index, strict, brief) for _ in range(HELD_OUT_USERS)]
    return evaluate_people(base_url, settings.model, people, settings.demo.seed + tenant.index,
                           api_key=tenant.api_key, turns_per_user=HELD_OUT_TURNS,
                           retries=settings.demo.retries_after_complaint)  # fmt: skip


def _served_now(base_url: str, settings: LiveLoopSettings, tenant: Tenant) -> dict[str, Any]:
    """Held-out figures and the same questions' replies, of what the tenant is served now."""
    return {
        "held_out": _held_out(base_url, settings, tenant),
        "same_questions": same_question_replies(base_url, settings.model, tenant.api_key),
    }


def same_question_replies(base_url: str, model: str, api_key: str) -> list[dict[str, Any]]:
    """The same questions at temperature 0 (not recorded), as this key is served now; the
    weather question comes with the weather tool, as the demo's users ask it."""
    headers = {"Authorization": f"Bearer {api_key}", "X-LiveLoop-Train": "false"}
    asks: list[tuple[str, list[dict[str, Any]] | None]] = [(q, None) for q in SAME_QUESTIONS]
    asks.append(("How is the weather in Oslo?", [WEATHER_TOOL]))
    out = []
    for question, tools in asks:
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": model_defaults(model).reply_tokens,
            "temperature": 0.0,
            **({"tools": tools} if tools else {}),
        }
        resp = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers,
                          timeout=300)  # fmt: skip
        resp.raise_for_status()
        message = resp.json()["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        reply = message.get("content") or "; ".join(
            f"[calls {c['function']['name']}({c['function']['arguments']})]" for c in calls
        )
        out.append({"question": question, "reply": reply,
                    "version": int(resp.headers.get("x-policy-version", "0"))})  # fmt: skip
    return out


def tenant_figures(
    turns: list[JudgedTurn],
    settings: LiveLoopSettings,
    base: dict[str, Any],
    final: dict[str, Any],
) -> dict[str, Any]:
    """One tenant's judged reward first/last window, held-out reward of the base and of what
    it was served at the end, the quality checks between them, and the same questions."""
    summary = summarise(turns, settings.demo.window_turns)
    held_out = final["held_out"]
    checks = headline({"eval": {"version 0": base, "final": held_out}})["quality_kept"]
    checks = {k: v for k, v in checks.items() if v is not None}  # no per-tenant probe NLL
    return {
        "turns": summary["judged_turns"],
        "window_turns": summary["window_turns"],
        "reward_first_window": summary["reward_first_window"],
        "reward_last_window": summary["reward_last_window"],
        "gain": _gain(summary),
        "gain_se": summary.get("improvement_se"),  # one standard error, from the windows' spread
        "versions": sorted({t.version for t in turns}),
        "held_out_reward": {"base": base["mean_reward"], "final": held_out["mean_reward"]},
        "quality": {
            "base": {k: v for k, v in base.items() if k != "replies"},
            "final": {k: v for k, v in held_out.items() if k != "replies"},
        },
        "quality_kept": checks,
        "same_questions": final["same_questions"],
    }


def _gain(summary: dict[str, Any]) -> float | None:
    first, last = summary["reward_first_window"], summary["reward_last_window"]
    return None if first is None or last is None else last - first


def isolation_checks(
    redis_url: str, data_dir: Path, turns: list[JudgedTurn], tenants: list[Tenant], scope: str
) -> dict[str, Any]:
    """Read back from the streams: every judged turn was served by the base, the shared
    adapter, or (tenant scope) its own tenant's adapter and no other; in tenant scope every
    batch holds its named tenant's turns only."""
    ids = {_tenant_id(t) for t in tenants}
    tenant_of_key = {t.key: t.tenant for t in turns}
    foreign = [
        t.key for t in turns if t.adapter is not None and t.adapter in ids and t.adapter != t.tenant
    ]
    mixed, checked = [], 0
    for batch in _batches(redis_url, data_dir):
        checked += 1
        owners = {tenant_of_key.get(s.key) for s in batch.samples or []} - {None}
        if scope == "tenant" and (batch.tenant is None or owners - {batch.tenant}):
            mixed.append(batch.batch_id)
    return {
        "turns_checked": len(turns),
        "served_by_another_tenants_adapter": len(foreign),
        "batches_checked": checked,
        "batches_mixing_tenants": len(mixed),
        "passed": not foreign and not mixed,
    }


def _batches(redis_url: str, data_dir: Path) -> list[TrainingBatch]:
    """Every batch on `liveloop:batches`, samples read from their files where stored apart."""
    client = bus.redis_client_sync(redis_url)
    try:
        entries: Any = client.xrange(bus.stream_key(bus.BATCHES))
    finally:
        client.close()
    out = []
    for batch in bus.decode_entries(entries, TrainingBatch):
        if batch.samples is None and batch.path is not None:
            try:
                stored = (data_dir / batch.path).read_bytes()
            except OSError:
                continue  # trained and removed: nothing left to check
            batch = batch.model_copy(
                update={"samples": TrainingBatch.model_validate_json(stored).samples}
            )
        out.append(batch)
    return out

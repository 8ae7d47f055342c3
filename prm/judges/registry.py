"""Finding judges by name: the `liveloop.judges` entry-point group.

Installed packages register judges there (LiveLoop's own built-ins included). The built-ins
are also known without an installed distribution, so a source checkout on PYTHONPATH finds
them too; an installed entry point of the same name takes precedence.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint
from typing import Any

from pydantic import BaseModel, ValidationError

from liveloop.config import ConfigError, JudgeConfig, SharedSettings
from liveloop.plugins import named_plugins
from liveloop.prm.judges.base import Judge, JudgeContext

GROUP = "liveloop.judges"
BUILTIN = {
    "feedback": "liveloop.prm.judges.feedback:FeedbackJudge",
    "llm": "liveloop.prm.judges.llm:LLMJudge",
    "rules": "liveloop.prm.judges.rules:RulesJudge",
}


def available_judges() -> dict[str, EntryPoint]:
    """Every judge name that can be used, with the entry point that provides it."""
    return named_plugins(GROUP, BUILTIN)


def unknown_judge_error(name: str, available: dict[str, EntryPoint]) -> ConfigError:
    """The one-line start-up error for a judge name nobody registered."""
    names = ", ".join(available) or "(none)"
    return ConfigError(f"unknown judge {name!r}; available judges: {names}")


def server_url(shared: SharedSettings) -> str:
    """This LiveLoop server's /v1 (a wildcard bind address is reached through loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(shared.host, shared.host)
    return f"http://{host}:{shared.port}/v1"


def _judge_settings(name: str, factory: Any, judging: JudgeConfig) -> BaseModel | None:
    """The judge's own settings, validated against its `settings_model`; ConfigError names keys."""
    where = judging.args_location(name)
    raw = judging.args_for(name)
    model: type[BaseModel] | None = getattr(factory, "settings_model", None)
    if model is None:
        if raw:
            raise ConfigError(f"{where}: judge {name!r} takes no settings")
        return None
    if isinstance(raw, model):
        return raw
    data = raw.model_dump() if isinstance(raw, BaseModel) else raw
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join([where, *(str(p) for p in e['loc'])])}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"invalid configuration: {problems}") from None


def judge_context(
    name: str, judging: JudgeConfig, shared: SharedSettings, factory: Any = None
) -> JudgeContext:
    """What the factory of judge `name` receives (its settings checked against `factory`)."""
    if factory is None:
        available = available_judges()
        if name not in available:
            raise unknown_judge_error(name, available)
        factory = available[name].load()
    return JudgeContext(
        name=name,
        settings=_judge_settings(name, factory, judging),
        model=shared.model,
        server_url=server_url(shared),
        data_dir=shared.data_dir,
        hint_chars=judging.hint_chars,
    )


def load_judge(name: str, judging: JudgeConfig, shared: SharedSettings) -> Judge:
    """Build the judge registered as `name`; unknown or broken plugins raise ConfigError."""
    available = available_judges()
    if name not in available:
        raise unknown_judge_error(name, available)
    try:
        factory = available[name].load()
        judge = factory(judge_context(name, judging, shared, factory))
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"judge {name!r} failed to load: {type(exc).__name__}: {exc}") from None
    if not isinstance(judge, Judge):
        raise ConfigError(
            f"judge {name!r} lacks part of the Judge protocol (`name`, `inline`, async "
            "`score(request)` and `aclose()`): subclass liveloop.prm.judges.JudgeBase"
        )
    return judge


def load_judges(
    names: dict[str, float], judging: JudgeConfig, shared: SharedSettings
) -> list[tuple[Judge, float]]:
    """Every configured judge with its weight; all names are checked before any is built."""
    available = available_judges()
    for name in names:
        if name not in available:
            raise unknown_judge_error(name, available)
    return [(load_judge(name, judging, shared), weight) for name, weight in names.items()]

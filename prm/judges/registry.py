"""Finding judges by name: the `liveloop.judges` entry-point group.

Installed packages register judges there (LiveLoop's own built-ins included). The built-ins
are also known without an installed distribution, so a source checkout on PYTHONPATH finds
them too; an installed entry point of the same name takes precedence.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING

from liveloop.config import ConfigError
from liveloop.prm.judges.base import Judge

if TYPE_CHECKING:
    from liveloop.config import LiveLoopSettings

GROUP = "liveloop.judges"
BUILTIN = {
    "feedback": "liveloop.prm.judges.feedback:FeedbackJudge",
    "llm": "liveloop.prm.judges.llm:LLMJudge",
    "rules": "liveloop.prm.judges.rules:RulesJudge",
}


def available_judges() -> dict[str, EntryPoint]:
    """Every judge name that can be used, with the entry point that provides it."""
    found = {name: EntryPoint(name, value, GROUP) for name, value in BUILTIN.items()}
    for ep in entry_points(group=GROUP):
        found[ep.name] = ep
    return dict(sorted(found.items()))


def unknown_judge_error(name: str, available: dict[str, EntryPoint]) -> ConfigError:
    """The one-line start-up error for a judge name nobody registered."""
    names = ", ".join(available) or "(none)"
    return ConfigError(f"unknown judge {name!r}; available judges: {names}")


def load_judge(name: str, settings: LiveLoopSettings) -> Judge:
    """Build the judge registered as `name`; unknown or broken plugins raise ConfigError."""
    available = available_judges()
    if name not in available:
        raise unknown_judge_error(name, available)
    try:
        factory = available[name].load()
        judge = factory(settings)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"judge {name!r} failed to load: {type(exc).__name__}: {exc}") from None
    if not isinstance(judge, Judge):
        raise ConfigError(f"judge {name!r} has no `name` and async `score(request)`")
    return judge


def load_judges(names: dict[str, float], settings: LiveLoopSettings) -> list[tuple[Judge, float]]:
    """Every configured judge with its weight; all names are checked before any is built."""
    available = available_judges()
    for name in names:
        if name not in available:
            raise unknown_judge_error(name, available)
    return [(load_judge(name, settings), weight) for name, weight in names.items()]

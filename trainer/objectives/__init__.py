"""Training objectives: the one place that turns `trainer.objective` into an objective class.

Built in: `rl` (`rl.py`), `opd` (`opd.py`), `combine` (`combine.py`). A custom objective is
named by import path (`kind = "custom"`) and must subclass `Objective` (`base.py`);
`objective_class` resolves and checks it, and the trainer calls it when it starts, so a bad
path stops start-up with a message naming the setting.
"""

from __future__ import annotations

import importlib

from liveloop.config.base import ConfigError
from liveloop.config.objective import CustomObjectiveConfig, ObjectiveConfig
from liveloop.trainer.objectives.base import (
    Needs,
    Objective,
    ObjectiveContext,
    ObjectiveReport,
    Tally,
    TokenInputs,
    TokenSignal,
)
from liveloop.trainer.objectives.combine import CombineObjective
from liveloop.trainer.objectives.opd import OPDObjective
from liveloop.trainer.objectives.rl import RLObjective

__all__ = [
    "BUILTIN",
    "Needs",
    "Objective",
    "ObjectiveContext",
    "ObjectiveReport",
    "Tally",
    "TokenInputs",
    "TokenSignal",
    "build_objective",
    "objective_class",
]

BUILTIN: dict[str, type[Objective]] = {
    cls.name: cls for cls in (RLObjective, OPDObjective, CombineObjective)
}


def _import_class(cfg: CustomObjectiveConfig) -> type[Objective]:
    module_name, _, attr = cfg.import_path.partition(":")
    where = f"trainer.objective.import_path = {cfg.import_path!r}"
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{where}: cannot import it ({exc})") from None
    if not (isinstance(found, type) and issubclass(found, Objective)):
        raise ConfigError(f"{where}: not a subclass of liveloop.trainer.objectives.Objective")
    return found


def objective_class(cfg: ObjectiveConfig) -> type[Objective]:
    """The class `trainer.objective` names (ConfigError for a custom one that is not there)."""
    if isinstance(cfg, CustomObjectiveConfig):
        return _import_class(cfg)
    return BUILTIN[cfg.kind]


def build_objective(context: ObjectiveContext) -> Objective:
    """The configured objective, built for `context.policy`."""
    cfg = context.trainer.objective
    options = cfg.options if isinstance(cfg, CustomObjectiveConfig) else {}
    cls = objective_class(cfg)
    return cls(
        ObjectiveContext(
            context.policy, context.trainer, context.model_name, options, context.cache
        )
    )

"""Settings that choose the trainer's objective (`trainer.objective`): what each token's advantage is.

A plain name selects a built-in objective (`objective = "combine"`, or
`LIVELOOP_TRAINER__OBJECTIVE=combine`); a table selects one by `kind`, and `kind = "custom"`
names an importable class (`import_path = "package.module:ClassName"`) with its own
`options`. The trainer resolves the class when it starts, so a bad path stops start-up.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator

from liveloop.config.base import Section

# The built-in objectives, by name (`demo.objectives` runs these).
BuiltinObjective = Literal["rl", "opd", "combine"]


class RLObjectiveConfig(Section):
    """The judged score, against a baseline, as every token's advantage."""

    kind: Literal["rl"] = Field("rl", description="The reward-only objective.")


class OPDObjectiveConfig(Section):
    """Hindsight-guided on-policy distillation only (its settings: `trainer.opd`)."""

    kind: Literal["opd"] = Field(
        "opd",
        description="Each token's advantage is the teacher signal of `trainer.opd`; turns "
        "without a directive hint are not trained.",
    )


class CombineObjectiveConfig(Section):
    """The reward and the distillation signal, weighted (`trainer.opd.rl_weight`, `opd_weight`)."""

    kind: Literal["combine"] = Field(
        "combine",
        description="Reward plus distillation advantages; turns without a hint learn from the "
        "reward alone.",
    )


class CustomObjectiveConfig(Section):
    """An objective class of your own, a subclass of `liveloop.trainer.objectives.Objective`."""

    kind: Literal["custom"] = Field("custom", description="An objective named by import path.")
    import_path: str = Field(
        description="Where the class is: 'package.module:ClassName' (importable by the trainer)."
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the class as `context.options`."
    )

    @field_validator("import_path")
    @classmethod
    def _module_and_class(cls, path: str) -> str:
        module, _, name = path.partition(":")
        if not module or not name:
            raise ValueError("import_path must look like 'package.module:ClassName'")
        return path


def _name_to_table(value: Any) -> Any:
    """`"combine"` is shorthand for `{kind = "combine"}`."""
    return {"kind": value} if isinstance(value, str) else value


ObjectiveConfig = Annotated[
    RLObjectiveConfig | OPDObjectiveConfig | CombineObjectiveConfig | CustomObjectiveConfig,
    Field(discriminator="kind"),
    BeforeValidator(_name_to_table),
]

"""Shared base class for config sections: unknown keys are errors, not silently ignored."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section. `extra="forbid"` makes a typo in TOML or env stop start-up."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

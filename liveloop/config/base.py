"""Shared base of config sections (unknown keys are errors, not silently ignored), and the error."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section. `extra="forbid"` makes a typo in TOML or env stop start-up."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ConfigError(ValueError):
    """A configuration problem, with a one-line message naming the offending key."""

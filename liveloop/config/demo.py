"""Settings of `liveloop demo` and `liveloop eval`."""

from pydantic import Field

from liveloop.config.base import Section


class DemoConfig(Section):
    """Simulated users and the learning-curve report."""

    minutes: float = Field(15.0, gt=0, description="Length of the demo run.")
    users: int = Field(8, ge=1, description="Concurrent simulated users.")
    seed: int = Field(0, description="Seed of the simulated user population.")
    window_turns: int = Field(64, ge=4, description="Turns in the first/last window of the report.")

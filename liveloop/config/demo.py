"""Settings of `liveloop demo` and `liveloop eval`."""

from typing import Literal, get_args

from pydantic import Field, field_validator

from liveloop.config.base import Section
from liveloop.config.objective import BuiltinObjective
from liveloop.seeds import derived_seed

TenantStyle = Literal["brief", "explained", "weather_tool"]


class DemoConfig(Section):
    """Simulated users and the learning-curve report."""

    minutes: float = Field(15.0, gt=0, description="Length of the demo run.")
    users: int = Field(8, ge=1, description="Concurrent simulated users.")
    seed: int = Field(0, description="Seed of the simulated user population.")
    weather_share: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Share of the simulated users (live and held-out) who ask about the weather "
        "and want it answered through the weather tool. Unset: one user in eight.",
    )
    tool_probes: int = Field(
        32,
        ge=0,
        description="Held-out weather questions asked of version 0 and of the final version "
        "at the end, each as a session's first message with the weather tool offered and "
        "its own sampling seed (the same for both versions); the "
        "report shows how many first replies called the tool. 0 (or weather_share 0): none.",
    )
    turns_per_update: int = Field(
        0,
        ge=0,
        description="Pace the users by the trainer: before each request they wait while the "
        "judged turns number this many per published version or more, so the cores go to "
        "learning rather than to turns that are never trained on (the collector then packs "
        "up to this many turns a batch). 0: users talk as fast as they are answered.",
    )
    retries_after_complaint: int = Field(
        0,
        ge=0,
        description="Times a simulated user (live or held-out) asks a question again after a "
        "reply it rated below 0, sending its complaint and the same question in one message, "
        "before it moves on to a new one. 0: every reaction comes with a new question, and "
        "a complaint that names the topic it is about ('I asked about rivers') then arrives "
        "with a question on another topic.",
    )
    paired_draws: bool = Field(
        True,
        description="Seed the sampling of every live request from the demo's seed, the "
        "tenant, the user and the request's number, so that runs compared side by side "
        "(scopes, objectives) make the same random draws and serve the same replies until "
        "their first updates part them. Every request still has a seed of its own. False: "
        "unseeded sampling.",
    )
    window_turns: int = Field(64, ge=4, description="Turns in the first/last window of the report.")
    objectives: list[BuiltinObjective] = Field(
        default_factory=lambda: list[BuiltinObjective](["rl"]),
        min_length=1,
        description="Training objectives to run, one after the other, each for `minutes` with "
        "the same users; the report compares their reward curves when there are several.",
    )
    tenants: int = Field(
        0,
        ge=0,
        le=32,
        description="Tenants, each with an API key of its own and users who all hold its house "
        "style (brief, explained, weather tool, then again in turn): the personal-agents demo, "
        "run once per scope in `scopes` and reported as a matrix. 0: one population, no keys.",
    )
    users_per_style: dict[TenantStyle, int] = Field(
        default_factory=dict,
        description="With tenants: how many simulated users each tenant of a house style has "
        "(all three styles named, at least one user each); `users` is then not used. Empty: "
        "`users` shared out among the tenants in turn.",
    )
    scopes: list[Literal["tenant", "shared"]] = Field(
        default_factory=lambda: list[Literal["tenant", "shared"]](["tenant", "shared"]),
        min_length=1,
        description="With tenants: the trainer scopes to run, one after the other, each for "
        "`minutes` with the same tenants and users ('tenant': an adapter per tenant; 'shared': "
        "one policy learning from every tenant's turns).",
    )
    brief_words: int = Field(
        20,
        ge=1,
        description="With tenants: the brief tenant's word limit (its users want answers of at "
        "most this many words). 20 is the tightest word limit the one-tenant demo gives "
        "smollm2's and the Qwen models' users: their replies start at 30-40 words.",
    )
    sense_model: str | None = Field(
        None,
        description="A judge model (alias or path) the demo serves in a process of its own "
        "and asks whether each held-out reply of version 0 and of the final version answers "
        "its question sensibly; the report shows both rates. Unset = no sense judge.",
    )
    sense_gate: bool = Field(
        False,
        description="With sense_model: the promotion gate asks the same judge about its probe "
        "replies and refuses a version that loses sense (trainer.gate.max_sense_drop).",
    )
    reward_threshold: float = Field(
        0.5,
        ge=-1,
        le=1,
        description="The report counts judged turns until the moving reward (over window_turns) "
        "first reaches this.",
    )

    @field_validator("users_per_style")
    @classmethod
    def _every_style_has_users(cls, value: dict[TenantStyle, int]) -> dict[TenantStyle, int]:
        """Tenants take the styles in turn, so a count must cover each style, and be >= 1."""
        if not value:
            return value
        missing = sorted(set(get_args(TenantStyle)) - set(value))
        if missing:
            raise ValueError(f"name every house style; missing: {', '.join(missing)}")
        if min(value.values()) < 1:
            raise ValueError("every tenant needs at least one user")
        return value

    def live_sample_seed(self, *names: object) -> int | None:
        """The sampling seed of one live population (`names` tell populations of a run apart,
        e.g. the tenant), the same in every run compared; None unless `paired_draws`."""
        return derived_seed("live", self.seed, *names) if self.paired_draws else None

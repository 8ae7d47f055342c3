"""The settings every loop shares, and nothing secret.

A loop receives these plus its own section (`server`, `prm`, `collector`, `trainer`),
never the whole tree: where the data, Redis and the registry are, which model, and the rules
several loops must agree on (`max_staleness`, applied by the collector and again by the
trainer). API keys and the admin key are the server's alone (`AuthSettings`).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from liveloop.config.base import ConfigError
from liveloop.config.defaults import model_defaults
from liveloop.logs import check_level


class SharedSettings(BaseModel):
    """Values every loop may read (the top level of the settings tree, minus secrets)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    data_dir: Path = Field(
        Path(".liveloop"),
        description="SQLite file, checkpoints, spool, embedded Valkey data and demo reports.",
    )
    model: str = Field(
        "smollm2-135m",
        description="Local HF directory, hub id, .gguf file, or alias (smollm2-135m, tiny-random).",
    )
    host: str = Field("127.0.0.1", description="Address the HTTP server binds to.")
    port: int = Field(8000, ge=0, le=65535, description="Port of the HTTP server (0 = any free).")
    redis_url: str | None = Field(
        None, description="Redis/Valkey URL; unset: `liveloop up` starts the embedded Valkey."
    )
    db_url: str | None = Field(
        None, description="SQLAlchemy URL of the registry; unset: SQLite under the data dir."
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Port of /metrics for judge/collect/train; unset = none."
    )
    log_level: str = Field(
        "INFO",
        description="Logging level of LiveLoop's own loggers: DEBUG, INFO, WARNING, ERROR or "
        "CRITICAL. Third-party libraries log warnings and errors only, except at DEBUG.",
    )
    seed: int = Field(0, description="Global seed (model init for tiny-random, sampling defaults).")
    threads: int | None = Field(
        None,
        ge=1,
        description="Torch CPU threads of each loop process (OMP_NUM_THREADS, when that "
        "variable is not set already); unset: torch's default, one per core.",
    )
    max_staleness: int = Field(
        4,
        ge=0,
        description=(
            "Drop turns whose oldest token is more than this many versions behind the trainer; "
            "0 = on-policy only (the synchronous baseline). The collector applies it, and the "
            "trainer again when a batch reaches it."
        ),
    )

    tool_result_reminder: str | None = Field(
        None,
        description="A system message put after each run of tool results wherever a "
        "conversation becomes a prompt (the server, the promotion gate's probes and "
        "hindsight distillation render alike), for models that call a tool again instead of "
        "answering from its result; `{name}`: the functions those results answer. It is "
        "part of the prompt ids a turn records. Unset: the model's default (the Qwen2.5-Coder "
        "aliases have one, other models none); empty: none.",
    )

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, level: str) -> str:
        return check_level(level)

    @property
    def effective_db_url(self) -> str:
        """The registry URL: `db_url`, or a SQLite file under the data dir."""
        return self.db_url or f"sqlite:///{(self.data_dir / 'registry.sqlite').resolve()}"

    @property
    def effective_tool_result_reminder(self) -> str:
        """`tool_result_reminder`, or the model's default where it is unset."""
        if self.tool_result_reminder is not None:
            return self.tool_result_reminder
        return model_defaults(self.model).tool_result_reminder

    @property
    def checkpoints_dir(self) -> Path:
        """Where the trainer writes checkpoints."""
        return self.data_dir / "checkpoints"

    @property
    def spool_dir(self) -> Path:
        """Where the server spools turn records while Redis is unreachable."""
        return self.data_dir / "spool"

    def require_redis(self, command: str) -> str:
        """The Redis URL; ConfigError naming the flag when `liveloop <command>` has none."""
        if not self.redis_url:
            raise ConfigError(f"liveloop {command} needs --redis-url (or LIVELOOP_REDIS_URL)")
        return self.redis_url


class AuthSettings(BaseModel):
    """The serving loop's secrets: accepted API keys and the admin key."""

    model_config = ConfigDict(frozen=True)

    api_keys: list[str] = Field(default_factory=list, description="Accepted Bearer tokens.")
    admin_key: str | None = Field(None, description="Key for /admin/*; None = admin off.")

"""One settings tree for every LiveLoop process.

Values come, from lowest to highest precedence, from the field defaults, a TOML file
(`--config FILE.toml`), `LIVELOOP_*` environment variables (nested sections with `__`,
e.g. `LIVELOOP_TRAINER__LR=1e-5`), and CLI flags. Unknown keys and bad values raise
`ConfigError` naming the key.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Self

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from liveloop.config.collector import CollectorConfig
from liveloop.config.demo import DemoConfig
from liveloop.config.prm import JudgeConfig, LLMJudgeConfig
from liveloop.config.server import ServerConfig
from liveloop.config.sglang import SGLangConfig
from liveloop.config.trainer import LoraSettings, TrainerConfig

__all__ = [
    "CollectorConfig",
    "ConfigError",
    "DemoConfig",
    "JudgeConfig",
    "LLMJudgeConfig",
    "LiveLoopSettings",
    "LoraSettings",
    "SGLangConfig",
    "ServerConfig",
    "TrainerConfig",
    "load_settings",
]


class ConfigError(ValueError):
    """A configuration problem, with a one-line message naming the offending key."""


class LiveLoopSettings(BaseSettings):
    """The whole configuration: common settings plus one section per loop."""

    model_config = SettingsConfigDict(
        env_prefix="LIVELOOP_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
    )

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
    api_keys: str = Field(
        "", description="Comma-separated API keys accepted as Bearer tokens; empty = open."
    )
    admin_key: str | None = Field(None, description="Key for /admin/* routes; unset = admin off.")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Port of /metrics for judge/collect/train; unset = none."
    )
    log_level: str = Field("INFO", description="Python logging level.")
    seed: int = Field(0, description="Global seed (model init for tiny-random, sampling defaults).")
    server: ServerConfig = Field(default_factory=ServerConfig)
    prm: JudgeConfig = Field(default_factory=JudgeConfig)
    collector: CollectorConfig = Field(default_factory=CollectorConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    demo: DemoConfig = Field(default_factory=DemoConfig)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """CLI flags (init kwargs) > environment > TOML file > defaults."""
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))

    @model_validator(mode="after")
    def _admin_key_is_not_an_api_key(self) -> Self:
        """The admin key must not open the chat API, nor an API key the admin API."""
        if self.admin_key and self.admin_key.strip() in self.api_key_list:
            raise ValueError("admin_key must differ from every API key in api_keys")
        return self

    # Derived locations -------------------------------------------------------------
    @property
    def api_key_list(self) -> list[str]:
        """The accepted API keys, parsed from the comma-separated setting."""
        return [k.strip() for k in self.api_keys.split(",") if k.strip()]

    @property
    def effective_db_url(self) -> str:
        """The registry URL: `db_url`, or a SQLite file under the data dir."""
        return self.db_url or f"sqlite:///{(self.data_dir / 'registry.sqlite').resolve()}"

    @property
    def checkpoints_dir(self) -> Path:
        """Where the trainer writes checkpoints."""
        return self.data_dir / "checkpoints"

    @property
    def spool_dir(self) -> Path:
        """Where the server spools turn records while Redis is unreachable."""
        return self.data_dir / "spool"


def tenant_id(api_key: str | None) -> str:
    """A stable, non-reversible id of an API key (never the key itself)."""
    if not api_key:
        return "anonymous"
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:12]


def _format_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown setting"
        parts.append(f"{key}: {msg}")
    return "invalid configuration: " + "; ".join(parts)


def load_settings(config_file: Path | str | None = None, **overrides: Any) -> LiveLoopSettings:
    """Build the settings tree; raises ConfigError naming the bad key.

    `overrides` are CLI flags: dotted or nested values (`{"trainer": {"lr": 1e-4}}`);
    `None` values are ignored so unset flags do not shadow env or TOML.
    """
    toml_path: Path | None = None
    if config_file is not None:
        toml_path = Path(config_file)
        if not toml_path.is_file():
            raise ConfigError(f"config file not found: {toml_path}")

    class _Settings(LiveLoopSettings):
        model_config = SettingsConfigDict(toml_file=toml_path)

    clean = {k: v for k, v in overrides.items() if v is not None}
    try:
        return _Settings(**clean)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None
    except (OSError, ValueError) as exc:  # TOML syntax errors and unreadable files
        raise ConfigError(f"cannot read config {toml_path}: {exc}") from None

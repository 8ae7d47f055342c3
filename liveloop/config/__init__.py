"""One settings tree for every LiveLoop process.

Values come, from lowest to highest precedence, from the field defaults, a TOML file
(`--config FILE.toml`), `LIVELOOP_*` environment variables (nested sections with `__`,
e.g. `LIVELOOP_TRAINER__LR=1e-5`), and CLI flags. Unknown keys and bad values raise
`ConfigError` naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from liveloop.config.base import ConfigError
from liveloop.config.collector import CollectorConfig
from liveloop.config.demo import DemoConfig
from liveloop.config.prm import JudgeConfig, LLMJudgeConfig
from liveloop.config.server import ServerConfig
from liveloop.config.sglang import SGLangConfig
from liveloop.config.shared import AuthSettings, SharedSettings
from liveloop.config.trainer import LoraSettings, TrainerConfig

__all__ = [
    "AuthSettings",
    "CollectorConfig",
    "ConfigError",
    "DemoConfig",
    "JudgeConfig",
    "LLMJudgeConfig",
    "LiveLoopSettings",
    "LoraSettings",
    "SGLangConfig",
    "ServerConfig",
    "SharedSettings",
    "TrainerConfig",
    "load_settings",
]


class LiveLoopSettings(SharedSettings, BaseSettings):
    """The whole configuration: shared settings, the server's secrets, one section per loop."""

    model_config = SettingsConfigDict(
        env_prefix="LIVELOOP_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
    )

    api_keys: str = Field(
        "", description="Comma-separated API keys accepted as Bearer tokens; empty = open."
    )
    admin_key: str | None = Field(None, description="Key for /admin/* routes; unset = admin off.")
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

    def shared(self) -> SharedSettings:
        """The shared part, for a loop (no section, no secret)."""
        return SharedSettings.model_validate(
            self.model_dump(include=set(SharedSettings.model_fields))
        )

    def auth(self) -> AuthSettings:
        """The serving loop's secrets."""
        return AuthSettings(api_keys=self.api_key_list, admin_key=self.admin_key)

    @property
    def api_key_list(self) -> list[str]:
        """The accepted API keys, parsed from the comma-separated setting."""
        return [k.strip() for k in self.api_keys.split(",") if k.strip()]


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

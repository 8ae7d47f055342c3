"""One settings tree for every LiveLoop process.

Values come, from lowest to highest precedence, from the field defaults, TOML files
(`--config FILE.toml`, repeatable: a later file overrides an earlier one key by key, so a
demo preset can sit under your own file), `LIVELOOP_*` environment variables (nested
sections with `__`, e.g. `LIVELOOP_TRAINER__LR=1e-5`), and CLI flags. Unknown keys and bad
values raise `ConfigError` naming the key.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Self

from pydantic import Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from liveloop.config.base import ConfigError
from liveloop.config.collector import CollectorConfig
from liveloop.config.demo import DemoConfig
from liveloop.config.prm import JudgeConfig, LLMJudgeConfig
from liveloop.config.retention import RetentionSettings
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
    "RetentionSettings",
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

    config_files: ClassVar[list[Path]] = []  # TOML files read, lowest precedence first

    api_keys: str = Field(
        "", description="Comma-separated API keys accepted as Bearer tokens; empty = open."
    )
    admin_key: str | None = Field(None, description="Key for /admin/* routes; unset = admin off.")
    server: ServerConfig = Field(default_factory=ServerConfig)
    prm: JudgeConfig = Field(default_factory=JudgeConfig)
    collector: CollectorConfig = Field(default_factory=CollectorConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    demo: DemoConfig = Field(default_factory=DemoConfig)
    retention: RetentionSettings = Field(default_factory=RetentionSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """CLI flags (init kwargs) > environment > TOML files > defaults."""
        return (init_settings, env_settings, LayeredToml(settings_cls, cls.config_files))

    @model_validator(mode="after")
    def _admin_key_is_not_an_api_key(self) -> Self:
        """The admin key must not open the chat API, nor an API key the admin API."""
        if self.admin_key and self.admin_key.strip() in self.api_key_list:
            raise ValueError("admin_key must differ from every API key in api_keys")
        return self

    @model_validator(mode="after")
    def _tenant_scope_needs_served_adapters(self) -> Self:
        """Tenant scope publishes adapters; an SGLang engine must be able to serve them."""
        sglang = self.server.engine == "sglang"
        if self.trainer.tenant_scope and sglang and not self.server.sglang.enable_lora:
            raise ValueError(
                "trainer.scope = 'tenant' serves one adapter per tenant: with server.engine = "
                "'sglang' set server.sglang.enable_lora = true (or trainer.scope = 'shared')"
            )
        return self

    @model_validator(mode="after")
    def _calls_wait_longer_than_their_answers_judging(self) -> Self:
        """A tool call waits for its answer's judgment, which the judge may give only after
        `next_state_timeout_s`: a shorter wait would credit almost no call."""
        wait, timeout = self.collector.call_credit_wait_s, self.prm.next_state_timeout_s
        if self.collector.call_credit > 0 and wait <= timeout:
            raise ValueError(
                f"collector.call_credit_wait_s ({wait:g}) must exceed prm.next_state_timeout_s "
                f"({timeout:g}): a call waits for its answer to be judged (or set "
                "collector.call_credit = 0)"
            )
        return self

    @model_validator(mode="after")
    def _a_full_batch_can_make_an_update(self) -> Self:
        """A batch ships on `collector.min_turns`: needing more samples for an update than
        that would leave most batches untrained."""
        need, ships = self.trainer.min_update_samples, self.collector.min_turns
        if need > ships:
            raise ValueError(
                f"trainer.min_update_samples ({need}) must be at most collector.min_turns "
                f"({ships}): a batch ships with that many turns and would make no update"
            )
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


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, table by table (a nested table is merged, not replaced)."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


class LayeredToml(PydanticBaseSettingsSource):
    """Several TOML files, each deep-merged over the ones before it."""

    def __init__(self, settings_cls: type[BaseSettings], files: list[Path]) -> None:
        super().__init__(settings_cls)
        self.files = files

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        """Unused: `__call__` returns the merged tables at once."""
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for path in self.files:
            with open(path, "rb") as fh:
                merged = deep_merge(merged, tomllib.load(fh))
        return merged


def _format_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown setting"
        parts.append(f"{key}: {msg}")
    return "invalid configuration: " + "; ".join(parts)


def load_settings(
    config_file: Path | str | Sequence[Path | str] | None = None, **overrides: Any
) -> LiveLoopSettings:
    """Build the settings tree; raises ConfigError naming the bad key.

    `config_file`: one TOML file or several (later ones override earlier ones key by key).
    `overrides` are CLI flags: dotted or nested values (`{"trainer": {"lr": 1e-4}}`);
    `None` values are ignored so unset flags do not shadow env or TOML.
    """
    if config_file is None:
        files: list[Path] = []
    elif isinstance(config_file, str | Path):
        files = [Path(config_file)]
    else:
        files = [Path(f) for f in config_file]
    for path in files:
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")

    class _Settings(LiveLoopSettings):
        config_files: ClassVar[list[Path]] = files

    clean = {k: v for k, v in overrides.items() if v is not None}
    try:
        return _Settings(**clean)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None
    except (OSError, ValueError) as exc:  # TOML syntax errors and unreadable files
        names = ", ".join(str(f) for f in files)
        raise ConfigError(f"cannot read config {names}: {exc}") from None

"""The settings tree: precedence TOML < env < flags, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from liveloop.config import ConfigError, load_settings
from liveloop.server.api.auth import tenant_id


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "liveloop.toml"
    path.write_text(text)
    return path


def test_precedence_toml_env_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = write(tmp_path, 'model = "tiny-random"\nport = 5001\n[trainer]\nlr = 0.5\n')
    assert load_settings(cfg).port == 5001
    monkeypatch.setenv("LIVELOOP_PORT", "5002")
    monkeypatch.setenv("LIVELOOP_TRAINER__LR", "0.25")
    s = load_settings(cfg)
    assert (s.model, s.port, s.trainer.lr) == ("tiny-random", 5002, 0.25)
    assert load_settings(cfg, port=5003).port == 5003
    assert load_settings(cfg, port=None).port == 5002  # unset flags do not shadow env


def test_unknown_key_names_it(tmp_path: Path) -> None:
    cfg = write(tmp_path, "[server]\nmax_batch_sise = 3\n")
    with pytest.raises(ConfigError, match=r"server\.max_batch_sise: unknown setting"):
        load_settings(cfg)


def test_bad_value_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIVELOOP_COLLECTOR__TOKEN_BUDGET", "-1")
    with pytest.raises(ConfigError, match=r"collector\.token_budget"):
        load_settings()
    monkeypatch.delenv("LIVELOOP_COLLECTOR__TOKEN_BUDGET")
    monkeypatch.setenv("LIVELOOP_MAX_STALENESS", "-1")
    with pytest.raises(ConfigError, match=r"max_staleness: Input should be greater"):
        load_settings()


def test_loops_get_shared_settings_without_secrets() -> None:
    settings = load_settings(api_keys="k1,k2", admin_key="adm", max_staleness=2, port=9)
    shared = settings.shared()
    assert (shared.max_staleness, shared.port) == (2, 9)
    assert "api_keys" not in shared.model_dump() and "admin_key" not in shared.model_dump()
    assert "k1" not in shared.model_dump_json() and "adm" not in shared.model_dump_json()
    assert settings.auth().api_keys == ["k1", "k2"] and settings.auth().admin_key == "adm"
    with pytest.raises(ConfigError, match="liveloop judge needs --redis-url"):
        shared.require_redis("judge")


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_settings(write(tmp_path, "this is = = not toml"))


def test_api_keys_and_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIVELOOP_API_KEYS", " k1 , k2,,")
    assert load_settings().api_key_list == ["k1", "k2"]
    assert tenant_id("k1") == tenant_id("k1") != tenant_id("k2")
    assert "k1" not in tenant_id("k1")


def test_every_field_documented() -> None:
    from pydantic import BaseModel

    from liveloop.config import LiveLoopSettings

    def walk(model: type[BaseModel], prefix: str) -> list[str]:
        missing = []
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                missing += walk(ann, f"{prefix}{name}.")
            elif not field.description:
                missing.append(prefix + name)
        return missing

    assert walk(LiveLoopSettings, "") == []


def test_a_call_must_wait_longer_than_the_judge_waits_for_its_answer(tmp_path: Path) -> None:
    short = "[prm]\nnext_state_timeout_s = 120\n[collector]\ncall_credit_wait_s = 60\n"
    with pytest.raises(ConfigError, match=r"call_credit_wait_s \(60\) must exceed"):
        load_settings(write(tmp_path, short))
    off = short + "call_credit = 0\n"
    assert load_settings(write(tmp_path, off)).collector.call_credit == 0


def test_an_update_may_not_need_more_samples_than_a_batch_ships_with(tmp_path: Path) -> None:
    high = "[trainer]\nmin_update_samples = 20\n[collector]\nmin_turns = 16\n"
    with pytest.raises(ConfigError, match=r"min_update_samples \(20\) must be at most"):
        load_settings(write(tmp_path, high))
    even = "[trainer]\nmin_update_samples = 20\n[collector]\nmin_turns = 20\n"
    assert load_settings(write(tmp_path, even)).trainer.min_update_samples == 20

"""Demo presets: one TOML file per built-in demo, read by `liveloop demo`.

A preset is an ordinary settings file (`liveloop up --config <preset>.toml` runs the same
loops without the simulated users): the model, the learning rate and adapters that show
learning within the demo's minutes, how the users are paced, which objective the demo
trains, and where the promotion gate's probes come from. `liveloop demo` puts the preset
under any `--config` file of yours, which in turn sits under `LIVELOOP_*` variables and flags.
"""

from __future__ import annotations

from pathlib import Path

from liveloop.config.base import ConfigError

DIRECTORY = Path(__file__).resolve().parent
# The preset of a model without one of its own.
FALLBACK = "smollm2-135m"


def available() -> list[str]:
    """Names of the presets that ship with LiveLoop."""
    return sorted(p.stem for p in DIRECTORY.glob("*.toml"))


def preset_path(name: str) -> Path:
    """The file of a preset by name, or a path to a TOML file of your own."""
    candidate = Path(name)
    if candidate.suffix == ".toml":
        if not candidate.is_file():
            raise ConfigError(f"preset file not found: {candidate}")
        return candidate
    path = DIRECTORY / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; built in: {', '.join(available())}")
    return path


def demo_preset(model: str, asked: str | None = None) -> Path:
    """The preset `liveloop demo` reads: the one asked for, the model's own, or the fallback."""
    if asked is not None:
        return preset_path(asked)
    return preset_path(model if model in available() else FALLBACK)

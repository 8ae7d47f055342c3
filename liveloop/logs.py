"""Logging set-up shared by every LiveLoop process."""

from __future__ import annotations

import logging
import os
import warnings


def setup_logging(level: str = "INFO", process: str = "liveloop") -> None:
    """Plain one-line logs with the process role; quiet third-party noise."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s [{process}] %(name)s: %(message)s",
        force=True,
    )
    for noisy in (
        "httpx",
        "httpx2",
        "openai",
        "httpcore",
        "urllib3",
        "filelock",
        "transformers",
        "uvicorn.access",
    ):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="transformers")

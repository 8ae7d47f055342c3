"""`liveloop up`: the supervised loops with the live terminal view, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from liveloop.config import LiveLoopSettings
from liveloop.status import LiveView
from liveloop.supervisor import Supervisor


def run_up(
    settings: LiveLoopSettings, *, config_files: list[Path] | None = None, quiet: bool = False
) -> None:
    """Run all four loops until Ctrl-C or SIGTERM; shows a live view unless quiet."""
    supervisor = Supervisor(settings, config_files=config_files)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    supervisor.start()
    view = LiveView(supervisor, quiet=quiet)
    print(
        f"LiveLoop is up: {supervisor.base_url}/v1 (Ctrl-C stops); logs in {settings.data_dir / 'logs'}"
    )
    try:
        with view:
            while not stop.wait(1.0):
                for event in supervisor.check():
                    view.event(event)
                view.refresh()
    finally:
        supervisor.stop()

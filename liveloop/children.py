"""Child processes that never outlive their parent (Valkey, the loops, the engine worker).

`die_with_parent` is meant as (part of) a `preexec_fn`: it runs in the child between fork
and exec and asks the kernel to SIGTERM the child when its parent dies, however abruptly.
`stop_process` is the one graceful stop of a child: SIGTERM, then SIGKILL after a grace.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux; a no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_process(proc: subprocess.Popen[bytes] | subprocess.Popen[str], timeout_s: float) -> int:
    """SIGTERM `proc` (if it still runs), SIGKILL it after `timeout_s`; its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode

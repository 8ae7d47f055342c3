"""Child processes that never outlive their parent (Valkey, the loops, the engine worker).

`die_with_parent` is meant as (part of) a `preexec_fn`: it runs in the child between fork
and exec and asks the kernel to SIGTERM the child when its parent dies, however abruptly.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux; a no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

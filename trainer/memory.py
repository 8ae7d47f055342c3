"""Hand memory the trainer has freed back to the operating system.

Each update frees gigabytes in tensors of a few megabytes (the merged copy the gate probes,
activations, generation logits), allocated from worker threads. glibc keeps such freed
blocks in its heaps for reuse rather than returning them, so without this the trainer's
resident memory climbs update after update until the kernel kills it. `malloc_trim`
returns the free pages of every heap (`bench/trainer_memory.py` measures the difference).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys


def release_freed_memory() -> bool:
    """Collect cyclic garbage, then return free heap pages to the OS (glibc only).

    True when the C library could be asked (Linux with glibc); False elsewhere, a no-op.
    """
    gc.collect()
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True

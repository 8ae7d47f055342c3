"""The trainer hands freed memory back to the OS after each update (glibc's malloc_trim)."""

from __future__ import annotations

import platform
import sys

from liveloop.trainer.memory import release_freed_memory


def test_freed_memory_goes_back_where_the_c_library_can_be_asked() -> None:
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert release_freed_memory() is glibc
    assert release_freed_memory() is glibc  # harmless to repeat

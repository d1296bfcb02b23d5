"""Keep freed memory in the process: steady-state allocation on a CPU (chapter 10).

Every forward pass allocates the same large temporaries again (a 2,048-token prefill
step makes tensors of 2-25 MB per layer). glibc's ``malloc`` serves blocks that large with
``mmap`` and returns them to the kernel on ``free``, so the next step faults every page
back in, and a page fault is expensive (on a VM even more so). GPU engines avoid the same cost with
PyTorch's caching allocator; on a CPU the fix is two ``mallopt`` settings:

* ``M_MMAP_THRESHOLD`` = 32 MiB (glibc's maximum): blocks up to that size come from the
  heap, which is reused, instead of fresh ``mmap`` regions;
* ``M_TRIM_THRESHOLD`` = 1 GiB: freed heap memory stays with the process instead of being
  handed back after every step.

With them, a prefill step faults in a few percent of the pages it did without, and runs
measurably faster (the figures: ``results/README.md``). The cost is that the process
keeps up to its peak working set of freed memory. The settings are
process-wide, so they are applied once, only on Linux with glibc, and never over a
choice the user made with glibc's own ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``
environment variables.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


@functools.lru_cache(maxsize=None)
def keep_freed_memory() -> bool:
    """Apply the two settings once per process. Returns whether they are in force."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in USER_VARIABLES):
        return False  # the user tuned malloc themselves
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
            bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False

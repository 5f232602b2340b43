"""Process-wide allocator settings for the processes that run the model stages."""

from __future__ import annotations

import ctypes
import functools

# mallopt(3) parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # the largest value glibc accepts on a 64-bit system


@functools.cache
def _mallopt():
    try:
        return ctypes.CDLL(None).mallopt  # the C library this process is linked against
    except (OSError, AttributeError):  # no mallopt (not glibc, or not a POSIX platform)
        return None


def keep_freed_memory(mmap_threshold: int = MMAP_THRESHOLD_MAX, trim_threshold: int = 1 << 30) -> bool:
    """Let glibc's malloc reuse freed memory instead of returning it to the kernel and faulting it
    in again on the next allocation. True if glibc accepted both settings.

    A step's temporaries on a CPU are megabytes (the logits of a verification step: 5 MB at 64
    requests x 5 tokens, its activations, a prompt chunk's attention mask): with glibc's defaults
    such a block comes from ``mmap`` and goes back with ``munmap``, and the next step pays a page
    fault and a zeroed page for every 4 KB of it. Serving blocks up to ``mmap_threshold`` from the
    heap, and keeping up to ``trim_threshold`` bytes of freed heap, makes a step reuse the memory
    the previous one freed; with the defaults a full batch's step takes 1.06-1.29x as long
    (docs/benchmarks.md, "Why the defaults").
    The cost is that a stage process keeps the memory of its largest step until it exits."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    ok_mmap = mallopt(M_MMAP_THRESHOLD, int(mmap_threshold))
    ok_trim = mallopt(M_TRIM_THRESHOLD, int(trim_threshold))
    return bool(ok_mmap) and bool(ok_trim)

"""Allocator settings of the stage processes (lightspec_core.memory)."""

from __future__ import annotations

import platform
import subprocess
import sys

from lightspec_core.stages import memory

ROUNDS = """
import resource, sys
import numpy as np
if sys.argv[1] == "keep":
    from lightspec_core.stages.memory import keep_freed_memory
    assert keep_freed_memory()
def one_round():  # what a step does: a few 10 MB temporaries, written, then freed
    bufs = [np.ones(10 << 17) for _ in range(3)]
    del bufs
one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    one_round()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_kept_memory_is_reused_without_page_faults():
    """Five rounds of 3 x 10 MB temporaries touch 38,400 pages. With glibc's defaults the freed heap
    goes back to the kernel and comes back page by page; once the stage setting is made, the rounds
    reuse what the first one left and fault (nearly) nothing."""
    if platform.libc_ver()[0] != "glibc":  # musl's mallopt is a no-op, macOS has none
        assert memory.keep_freed_memory() is False
        return
    kept, default = _page_faults("keep"), _page_faults("default")
    assert kept < 100, kept
    assert default > 10 * max(kept, 100), (default, kept)


def test_keep_freed_memory_says_false_where_the_settings_are_not_taken(monkeypatch):
    calls = []

    def refuse(param, value):
        calls.append((param, value))
        return 0  # mallopt's answer for a setting it does not take

    monkeypatch.setattr(memory, "_mallopt", lambda: refuse)
    assert memory.keep_freed_memory() is False
    assert calls == [(memory.M_MMAP_THRESHOLD, memory.MMAP_THRESHOLD_MAX), (memory.M_TRIM_THRESHOLD, 1 << 30)]
    monkeypatch.setattr(memory, "_mallopt", lambda: None)  # no mallopt in this C library
    assert memory.keep_freed_memory() is False

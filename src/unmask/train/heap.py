"""glibc's heap under a training loop whose tensors change size every step.

A training step allocates tensors of sizes that vary from step to step (the masked rows through the LM head, the
rows of each block size). glibc serves a request above its mmap threshold (128 KB at start) with a mapping of its
own, returned when freed, but each such free raises the threshold (up to 32 MB), so from then on megabyte tensors
come from the heap, whose free holes between longer-lived blocks stay resident: a 19.9M-parameter distillation on
the CPU grew by 25-80 MB a step, to ~12 GB (two such runs were OOM-killed on a 23 GB machine). `trim` after each
step hands the free pages back (glibc's malloc_trim(3) releases free pages inside the heap too). Fixing the mmap
threshold instead (mallopt M_MMAP_THRESHOLD) kept memory flatter but made steps ~1.5x slower here: every
megabyte tensor became fresh pages to fault in (docs/training.md, "Memory"). Since then the training commands run
under jemalloc where it is installed (unmask/allocator.py), which keeps its pages; there the trim does nothing.
"""
from __future__ import annotations

import ctypes
import sys

from unmask.allocator import active


def _malloc_trim():
    """glibc's malloc_trim, or None (not Linux, or a libc without it: musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL("libc.so.6"), "malloc_trim", None)
    except OSError:
        return None


# resolved once: trim runs after every training step; under jemalloc (unmask/allocator.py) glibc's heap holds
# next to nothing and jemalloc keeps its free pages on purpose
_MALLOC_TRIM = None if active() == "jemalloc" else _malloc_trim()


def trim() -> bool:
    """Return the heap's free pages to the system; False where there is no glibc malloc_trim (or jemalloc runs)."""
    return _MALLOC_TRIM is not None and _MALLOC_TRIM(0) >= 0

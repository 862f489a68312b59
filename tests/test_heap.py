"""heap.trim: megabyte blocks freed between long-lived small ones go back to the system, which glibc's heap
otherwise keeps (train/heap.py). Each case runs in a fresh interpreter."""
from __future__ import annotations

import subprocess
import sys

import pytest

# Holes a training step leaves: after one 8 MB block is freed (glibc raises its mmap threshold to 8 MB), 60
# blocks of 4 MB interleaved with small blocks that stay, then the 4 MB ones freed. Prints the RSS kept, in MB.
PROBE = """
import ctypes, sys
from unmask.train.heap import trim
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
def touch(p, n):
    ctypes.memset(p, 1, n)
    return p
libc.free(touch(libc.malloc(8 << 20), 8 << 20))
before = rss()
big, small = [], []
for _ in range(60):
    big.append(touch(libc.malloc(4 << 20), 4 << 20))
    small.append(touch(libc.malloc(64 << 10), 64 << 10))
for p in big:
    libc.free(p)
trimmed = trim() if sys.argv[1] == "trim" else False
print(trimmed, round(rss() - before))
"""


def _kept(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    trimmed, kept = out.stdout.split()
    return trimmed, int(kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_megabyte_blocks_go_back_to_the_system():
    plain_trimmed, plain = _kept("plain")
    trimmed, kept = _kept("trim")
    assert plain_trimmed == "False" and trimmed == "True"
    assert plain >= 200   # glibc alone: the 240 MB of freed 4 MB blocks stay resident in the heap's holes
    assert kept <= 20     # trimmed: their pages went back

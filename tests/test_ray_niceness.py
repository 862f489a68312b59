"""An engine replica's scheduling priority (cluster/replica.py `run_at`): Ray starts its workers at nice 15, and
Linux keeps a niceness per thread, so the replica sets every thread it has, the ones started before it (Ray's,
which carry each streamed item back) included, and the ones started after inherit it. Run in a child process:
raising a niceness cannot be undone without privilege, and this process's threads are not the test's to change.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="Ray is optional: pip install 'unmask[ray]'")

CHILD = r"""
import os, threading
from unmask.cluster.replica import run_at

def niceness(tid):   # field 19 of /proc/.../stat; the command name before it may hold spaces
    return int(open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()[16])

release = threading.Event()
early = [threading.Thread(target=release.wait) for _ in range(3)]   # as Ray's threads: there before run_at
for t in early:
    t.start()
start = os.getpriority(os.PRIO_PROCESS, 0)
run_at(start + 6)
late = threading.Thread(target=release.wait)   # as the engine's: started after
late.start()
tids = [int(t) for t in os.listdir("/proc/self/task")]
print(start, len(tids), sorted({niceness(t) for t in tids}))
release.set()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_run_at_sets_every_thread_of_the_process_and_the_ones_started_after():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    start, count, seen = out.stdout.split(maxsplit=2)
    assert int(count) >= 5   # the main thread, three early ones, the late one (and any the imports started)
    assert seen.strip() == f"[{min(int(start) + 6, 19)}]"

"""Per-process CPU ticks (utime + stime, 100 a second) between two moments: `cpu_snap.py save F`, later `cpu_snap.py diff F` (bench/ray_overhead_cpu.sh)."""
import os, sys, json, time
def snap():
    out = {}
    for pid in os.listdir('/proc'):
        if not pid.isdigit(): continue
        try:
            st = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()
            cmd = open(f'/proc/{pid}/cmdline').read().replace('\0', ' ')[:100]
        except OSError: continue
        out[pid] = (int(st[11]) + int(st[12]), cmd)
    return out
if sys.argv[1] == 'save':
    json.dump(snap(), open(sys.argv[2], 'w'))
else:
    a = json.load(open(sys.argv[2])); b = snap()
    rows = sorted(((b[p][0] - a[p][0], b[p][1]) for p in b if p in a), reverse=True)
    for d, c in rows[:18]:
        if d > 0: print(f"{d:6d} {c}")

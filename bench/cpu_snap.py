"""CPU ticks (utime + stime, 100 a second) per process, or per thread with --threads, between two moments:
`cpu_snap.py save F`, later `cpu_snap.py diff F [--threads]` (bench/ray_overhead_cpu.sh, docs/scale-out.md)."""
import json
import os
import sys


def snap() -> dict:
    """{"pid/tid": [ticks, process command line, thread name]} for every thread on the machine."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:100]
            for tid in os.listdir(f"/proc/{pid}/task"):
                stat = open(f"/proc/{pid}/task/{tid}/stat").read()
                fields = stat.rsplit(")", 1)[1].split()
                out[f"{pid}/{tid}"] = [int(fields[11]) + int(fields[12]), cmd, stat[stat.index("(") + 1:stat.rindex(")")]]
        except OSError:
            continue
    return out


def main() -> None:
    if sys.argv[1] == "save":
        json.dump(snap(), open(sys.argv[2], "w"))
        return
    before, now = json.load(open(sys.argv[2])), snap()
    rows: dict = {}
    for key, (ticks, cmd, name) in now.items():
        spent = ticks - before.get(key, [0])[0]
        group = (key, f"{name:16s} {cmd[:60]}") if "--threads" in sys.argv else (key.split("/")[0], cmd)
        rows[group] = rows.get(group, 0) + spent
    for (_, label), spent in sorted(rows.items(), key=lambda r: -r[1])[:24]:
        if spent > 0:
            print(f"{spent:6d} {label}")


if __name__ == "__main__":
    main()

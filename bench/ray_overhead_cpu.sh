#!/usr/bin/env bash
# Where the CPU goes in the scale-out overhead measurement (docs/scale-out.md): plain unmask serve (A) and --ray (B)
# both up and eager, per-process CPU ticks from /proc (bench/cpu_snap.py) idle for 20 s and over an interleaved
# loadtest. Environment: CONC (concurrency, default 4), ROUNDS (4), LT_ARGS (more loadtest flags).
set -u
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE
B=.venv/bin
$B/unmask serve --port 8371 --embedding-model off --no-compile-step > /tmp/a.log 2>&1 &
A=$!
$B/unmask serve --ray --port 8372 --replicas 1 --num-cpus 2 --embedding-model off --no-compile-step > /tmp/b.log 2>&1 &
R=$!
for p in 8371 8372; do for i in $(seq 600); do curl -sf localhost:$p/health >/dev/null && break; sleep 0.5; done; done
echo ready
python3 bench/cpu_snap.py save /tmp/cpu0
sleep 20
echo "== idle 20 s (ticks, 100/s)"
python3 bench/cpu_snap.py diff /tmp/cpu0
python3 bench/cpu_snap.py save /tmp/cpu0
$B/unmask loadtest --url http://127.0.0.1:8371 --compare http://127.0.0.1:8372 --concurrency ${CONC:-4} -n 64 \
    --output-len 32 --input-len 64 --ignore-eos --rounds ${ROUNDS:-4} --warmup 2 ${LT_ARGS:-} 2>&1 | tail -30
echo "== during loadtest (ticks)"
python3 bench/cpu_snap.py diff /tmp/cpu0
kill -INT $A $R; sleep 8; $B/ray stop --force >/dev/null 2>&1

#!/usr/bin/env bash
# unmask serve's default (the one-request step compiled at start) against --no-compile-step: time to ready, then
# the loadtest interleaved (A = eager, B = default); figures in docs/benchmarks.md. CONC=1,4 ROUNDS=3 by default.
set -u
cd "$(dirname "$0")/.."
B=.venv/bin
t0=$(date +%s.%N)
$B/unmask serve --port 8381 --no-compile-step --embedding-model off > "${TMPDIR:-/tmp}/serve-eager.log" 2>&1 &
A=$!
for i in $(seq 1200); do curl -sf localhost:8381/health >/dev/null && break; sleep 0.1; done
t1=$(date +%s.%N)
$B/unmask serve --port 8382 --embedding-model off > "${TMPDIR:-/tmp}/serve-default.log" 2>&1 &
C=$!
for i in $(seq 1200); do curl -sf localhost:8382/health >/dev/null && break; sleep 0.1; done
t2=$(date +%s.%N)
echo "ready: eager $(echo "$t1 - $t0" | bc) s, default $(echo "$t2 - $t1" | bc) s"
grep -i compil "${TMPDIR:-/tmp}/serve-default.log" | head -3
$B/unmask loadtest --url http://127.0.0.1:8381 --compare http://127.0.0.1:8382 --concurrency ${CONC:-1,4} -n 48 \
    --output-len 32 --input-len 64 --ignore-eos --rounds ${ROUNDS:-3} --warmup 2 2>&1 | tail -30
kill -INT $A $C; sleep 3

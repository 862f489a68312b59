#!/usr/bin/env bash
# Two `unmask serve` of the built-in model with its defaults: A under jemalloc (what `unmask serve` now re-executes
# itself with, src/unmask/allocator.py), B with UNMASK_ALLOCATOR=glibc; the loadtest's held-out completions,
# interleaved; each server's resident memory (VmRSS) before the load, after the first sweep point and at the end.
set -u
cd "$(dirname "$0")/.."
B=.venv/bin
UNMASK_ALLOCATOR=jemalloc $B/unmask serve --port 8393 --embedding-model off > "${TMPDIR:-/tmp}/serve-alloc-a.log" 2>&1 &
SA=$!
for i in $(seq 1200); do curl -sf localhost:8393/health >/dev/null && break; sleep 0.1; done
UNMASK_ALLOCATOR=glibc $B/unmask serve --port 8394 --embedding-model off > "${TMPDIR:-/tmp}/serve-alloc-b.log" 2>&1 &
SB=$!
for i in $(seq 1200); do curl -sf localhost:8394/health >/dev/null && break; sleep 0.1; done
rss() { echo "$1 A (jemalloc: $(grep -c libjemalloc /proc/$SA/maps) maps) $(grep VmRSS /proc/$SA/status | awk '{print $2}') kB," \
  "B (jemalloc: $(grep -c libjemalloc /proc/$SB/maps) maps) $(grep VmRSS /proc/$SB/status | awk '{print $2}') kB"; }
rss "ready:"
for c in ${CONCURRENCY:-1 4}; do
  $B/unmask loadtest --url http://127.0.0.1:8393 --compare http://127.0.0.1:8394 --endpoint completions \
      --dataset heldout --concurrency $c -n ${N:-192} --rounds ${ROUNDS:-4} --warmup 2 \
      --json "${OUT:-${TMPDIR:-/tmp}/serve-alloc}-c$c.json" 2>&1 | grep -v "^(client\|client / server" | tail -12
  rss "after concurrency $c:"
done
kill -INT $SA $SB; sleep 3

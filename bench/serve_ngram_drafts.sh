#!/usr/bin/env bash
# Two `unmask serve` of the built-in model with its defaults (bf16, one-request step compiled), the
# loadtest's held-out completions: A with the n-gram table (the default), B asked draft_ngrams false; interleaved.
# Two servers, so that B's prompts never hit a prefix cache A warmed.
set -u
cd "$(dirname "$0")/.."
B=.venv/bin
$B/unmask serve --port 8391 --embedding-model off > "${TMPDIR:-/tmp}/serve-ngram-a.log" 2>&1 &
SA=$!
for i in $(seq 1200); do curl -sf localhost:8391/health >/dev/null && break; sleep 0.1; done
$B/unmask serve --port 8392 --embedding-model off > "${TMPDIR:-/tmp}/serve-ngram-b.log" 2>&1 &
SB=$!
for i in $(seq 1200); do curl -sf localhost:8392/health >/dev/null && break; sleep 0.1; done
$B/unmask loadtest --url http://127.0.0.1:8391 --compare http://127.0.0.1:8392 --compare-extra-body '{"draft_ngrams": false}' \
    --endpoint completions --dataset heldout --concurrency 1,4 -n 48 --rounds ${ROUNDS:-3} --warmup 2 \
    --json "${OUT:-${TMPDIR:-/tmp}/ngram-serve.json}" 2>&1 | grep -v "^(client\|client / server" | tail -24
kill -INT $SA $SB; sleep 3

#!/usr/bin/env bash
# `tokenmill serve` end to end on one device, as a new user runs it: start, completions (plain, streamed, chat),
# bad input answered 400 with the server still up, /metrics, a short `tokenmill bench`, SIGINT drain.
#   scripts/serve_smoke.sh [serve args...]        e.g. --device cuda --cuda-graphs --speculative-model ngram ...
set -u
PORT=${PORT:-18123}
PY=${PY:-python3}
OUTD=${SMOKE_OUT:-/tmp/serve_smoke}
mkdir -p "$OUTD"
$PY -m tokenmill serve --model demo --port "$PORT" "$@" >"$OUTD/serve.log" 2>&1 &
PID=$!
for _ in $(seq 120); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 1; done
U=http://localhost:$PORT
echo "--- completion"; curl -s $U/v1/completions -H 'content-type: application/json' \
  -d '{"model":"demo","prompt":"def fibonacci(n):\n","max_tokens":48,"temperature":0}'; echo
echo "--- chat, streamed"; curl -sN $U/v1/chat/completions -H 'content-type: application/json' \
  -d '{"model":"demo","messages":[{"role":"user","content":"Write a function that reverses a list."}],"max_tokens":24,"stream":true}' | tail -n 3
echo "--- bad input (max_tokens -1): expect 400"
curl -s -o /dev/stderr -w '%{http_code}\n' $U/v1/completions -H 'content-type: application/json' \
  -d '{"model":"demo","prompt":"x","max_tokens":-1}'
echo "--- still answering: $(curl -s -o /dev/null -w '%{http_code}' $U/v1/completions -H 'content-type: application/json' -d '{"model":"demo","prompt":"x","max_tokens":4}')"
echo "--- metrics"; curl -s $U/metrics | grep -E '^(vllm:spec_decode_num_(drafts|accepted_tokens)|tokenmill_batch_invariant|vllm:generation_tokens_total|tokenmill_engine_steps_total)' | head
echo "--- bench"; timeout 120 $PY -m tokenmill bench --target $U --workload chat --rate 4 --num-requests 40 --out "$OUTD/bench" 2>&1 | tail -n 15
kill -INT $PID; wait $PID; echo "--- serve exited rc=$?"; tail -n 5 "$OUTD/serve.log"

#!/usr/bin/env bash
# The prepared check for a lent GPU (the `device` tool's machine: one H200, the image's python3 with its own
# torch; nothing installed): run from the repository root, writes logs and JSON under $OUT (default /tmp/device).
#   1. scripts/cuda_check.py: logits vs HF transformers on the GPU, greedy output with speculation and CUDA
#      graphs vs the plain engine, batch-1 speed of the demo pair
#   2. `tokenmill sim calibrate` on the GPU for an 8B-shaped model (8 of Llama-3.1-8B's 32 layers, random
#      weights): the measured step times the simulator's h200 roofline is checked against
#      (benchmarks/sim_roofline_check.py reads the profile)
#   3. benchmarks/gpu_precision.py on the same model: batch-1 decode vs the HBM roofline, bf16 / fp8 / graphs
#   4. scripts/serve_smoke.sh: `tokenmill serve --device cuda --cuda-graphs` with the draft model, end to end
#   lossless / step_profile(_graphs): cuda_check's lossless section alone (with `--batch-invariant on`: fixed tiles,
#      model/invariant.py), and benchmarks/cuda_step_profile.py (where an eager step's time goes)
# PARTS="cuda_check serve" runs a subset (names as in the `part` lines); the default is the session-23 set.
# Each part has its own time limit, so one that hangs or fails leaves the others their time.
set -u
OUT=${OUT:-/tmp/device}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENMILL_CPU_KERNELS=0
M8=/tmp/m8b
LOGS=/tmp/device_logs  # each part's whole log; $OUT/logs.txt gets them all (the device tool brings back 8 files)
mkdir -p "$LOGS"
PARTS=" ${PARTS:-cuda_check make_model calibrate gpu_precision calibrate_graphs serve} "  # which parts to run
part() {  # part NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  [[ "$PARTS" == *" $name "* ]] || return 0
  local t0=$SECONDS
  echo "=== $name (limit $secs s)"
  timeout "$secs" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"
  tail -n 40 "$LOGS/$name.log"
  { echo "=== $name rc=$rc in $((SECONDS - t0)) s"; cat "$LOGS/$name.log"; } >>"$OUT/logs.txt"
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
part cuda_check "${T_CHECK:-170}" python3 scripts/cuda_check.py --out /tmp/cc
cp /tmp/cc/result.json "$OUT/cuda_check.json" 2>/dev/null
part lossless "${T_LOSSLESS:-240}" python3 scripts/cuda_check.py --sections lossless --out /tmp/ccl
cp /tmp/ccl/result.json "$OUT/cuda_lossless.json" 2>/dev/null
part step_profile "${T_PROF:-120}" python3 benchmarks/cuda_step_profile.py --batch 1 8 32
part step_profile_graphs "${T_PROFG:-90}" python3 benchmarks/cuda_step_profile.py --batch 1 8 32 --cuda-graphs --top 10
part speed_invariant "${T_SPEEDI:-200}" python3 scripts/cuda_check.py --sections speed,batch --out /tmp/ccs \
  --speed-configs "plain,plain + invariant,ngram auto,ngram auto + invariant,draft auto + invariant"
cp /tmp/ccs/result.json "$OUT/cuda_speed_invariant.json" 2>/dev/null
part serve_invariant "${T_SERVEI:-120}" env SMOKE_OUT=/tmp/serve_smoke_inv bash scripts/serve_smoke.sh --device cuda \
  --batch-invariant on --speculative-model ngram --num-speculative-tokens auto
part serve_eager "${T_SERVEE:-120}" env SMOKE_OUT=/tmp/serve_smoke_eager PORT=18124 bash scripts/serve_smoke.sh --device cuda
part make_model "${T_MAKE:-60}" python3 -c "from tokenmill.model.make import make_model; \
make_model('llama-3.1-8b', '$M8', dtype='bfloat16', overrides={'num_hidden_layers': 8})"
part calibrate "${T_CAL:-110}" python3 -m tokenmill sim calibrate --model "$M8" --device cuda --dtype bfloat16 \
  --no-serving --kv-cache-bytes 24GiB --max-num-batched-tokens 8192 --contexts 256,1024,4096 \
  --decodes 1,8,32,128 --prefills 256,1024,4096 --repeats 3 --out "$OUT/h200_eager.json"
part gpu_precision "${T_GP:-110}" python3 benchmarks/gpu_precision.py --layers 8 --model-dir "$M8" --requests 32 \
  --tokens 64 --out /tmp/gp
cp /tmp/gp/result.json "$OUT/gpu_precision.json" 2>/dev/null
part calibrate_graphs "${T_CALG:-90}" python3 -m tokenmill sim calibrate --model "$M8" --device cuda --dtype bfloat16 \
  --cuda-graphs --max-model-len 8192 --no-serving --kv-cache-bytes 24GiB --max-num-batched-tokens 8192 \
  --contexts 256,1024,4096 --decodes 1,8,32 --prefills 256,1024,4096 --repeats 3 --out "$OUT/h200_graphs.json"
part serve "${T_SERVE:-120}" env SMOKE_OUT=/tmp/serve_smoke bash scripts/serve_smoke.sh --device cuda --cuda-graphs \
  --speculative-model demo-draft --num-speculative-tokens auto
echo "=== done in $SECONDS s"

#!/usr/bin/env bash
# The CUDA checks, as one command for a machine with a GPU (limits add up to 570 s, for a
# device call of 600 s; on an H200 it should take far less):
#
#   bash tools/device_check.sh        # results in $OUT (default ./device-out): log.txt, *.json, *.png
#
# 1. the engine on CUDA against transformers: logits and greedy tokens for every architecture
#    (the reference model runs on the CPU), engine behaviour, prefix caching and the host and
#    disk tiers (pinned host memory, the side stream for device-to-host copies); Redis tests
#    run only where redis-server is installed;
# 2. `bench throughput`: tierlm against transformers, both on the GPU, same run;
# 3. `bench prefix`: time to first token with a 2,000-token prefix on device / host / disk.
#
# Needs python3 with a CUDA torch and transformers (no network, no install); tierlm runs from
# this checkout. Each step has its own time limit and the next runs even if one fails: the
# first line of log.txt per step says how it ended.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
BENCH_MODEL="${TMPDIR:-/tmp}/tierlm-bench-llama-0.5b"

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit} s)" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $name: rc $rc in $((SECONDS - t0)) s" | tee -a "$LOG"
}

: >"$LOG"
step environment 30 python3 -c "
import torch, transformers
assert torch.cuda.is_available(), 'torch sees no CUDA device'
print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
step parity-and-tiers 200 python3 -m pytest -q -p no:cacheprovider tests/models/test_parity.py \
  tests/engine/test_engine_behaviour.py tests/kv/test_prefix_and_tiers.py -k "not packed"
step bench-throughput 240 python3 -m tierlm.cli bench throughput --device cuda --bench-model-dir "$BENCH_MODEL" \
  --workload uniform --workload mixed --json "$OUT/throughput.json" --plot "$OUT/throughput.png"
step bench-prefix 100 python3 -m tierlm.cli bench prefix --bench-model-dir "$BENCH_MODEL" \
  --json "$OUT/prefix.json" --plot "$OUT/prefix.png"
grep "^=== .*: rc" "$LOG"

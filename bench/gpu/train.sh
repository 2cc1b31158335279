#!/usr/bin/env bash
# nanoGPT's GPU example end to end on one GPU: examples/nanogpt/gpu.toml (6 layers, 6 heads,
# 384 wide, block 256, batch 64, dropout 0.2, 5000 steps) from the bundle prepare.sh made
# ('nnscaler train --bundle'), trained by nnscaler-rt alone; prints each evaluation's train
# and validation loss and the time per step. nanoGPT reaches about 1.47 validation loss
# with this config; ours must reach 1.48 or better. One device run has 10 minutes: this
# trains for at most TRAIN_SECONDS (default 480) and says how far it got and how long all
# 5000 steps would take; RESUME=1 continues from the checkpoint a run left in OUT.
#   DIR/train.sh [OUT]     (OUT: the log, loss curve and checkpoint; default DIR/train-out)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/train-out}
mkdir -p "$out"
cd "$out"
secs=${TRAIN_SECONDS:-480}
resume=()
if [ "${RESUME:-0}" = 1 ]; then resume=(--resume); fi
py=${PYTHON:-python3}
echo "== nanoGPT GPU example, $(date -u +%Y-%m-%dT%H:%M:%SZ); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
"$here/nnscaler-rt" info "$here/nanogpt-gpu.bundle" | head -1
"$here/nnscaler-rt" train "$here/nanogpt-gpu.bundle" --backend cuda --max-time "$secs" "${resume[@]}"
rc=$?
if [ -s train.jsonl ]; then
  "$py" "$here/compare.py" train train.jsonl 5000 1.48 $((64 * 256))
else
  echo "no training log in $out"
fi
exit $rc

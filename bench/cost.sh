#!/usr/bin/env bash
# The cost model against measurement (issue 14): calibrate this CPU by microbenchmarks
# (nnscaler calibrate), then for zoo models at several batch sizes compare the predicted
# time of one training step (forward + backward; --print-stats=cluster=...) with the
# CPU runtime's runs, one thread, by the thread's CPU time (nnscaler run --timing serial:
# time the host takes away is not counted; 5 runs, 41 for steps predicted under 10 ms),
# the calibration's microbenchmarks timed the same way (nnscaler calibrate --timing
# serial), whose figures are medians too. Prints predicted, the median and the fastest
# measured step, and predicted / median per model; the model is calibrated from
# microbenchmarks only, never from these timings.
#   bench/cost.sh [CASES...]   (a case: "FAMILY PRESET BATCH"; default: the list below)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$root/target/release
cargo build --release -q --bin nnscaler --bin nnscaler-opt --manifest-path "$root/Cargo.toml"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
"$bin/nnscaler" calibrate --device cpu --timing serial -o cpu.toml
if [ $# -eq 0 ]; then
  set -- "mlp mlp-tiny 64" "mlp mlp-tiny 1024" "gpt gpt-tiny 8" "gpt nanogpt-cpu 4" \
    "gpt nanogpt-cpu 12" "gpt nanogpt-cpu 32" "llama llama-tiny 8" "gpt gpt2-124m 1"
fi
printf '%-26s %12s %12s %12s %7s\n' model predicted median fastest ratio
for c in "$@"; do
  read -r family preset batch <<< "$c"
  "$bin/nnscaler" import "$family" --preset "$preset" --batch "$batch" -o m.mlir
  "$bin/nnscaler-opt" --autodiff m.mlir -o step.mlir
  pred=$("$bin/nnscaler-opt" --print-stats=cluster=cpu.toml step.mlir -o /dev/null 2>&1 |
    sed -n 's/^predicted time per run[^:]*: \([0-9.]*\) s.*/\1/p')
  "$bin/nnscaler" data random step.mlir -o batch.safetensors
  repeat=$(awk "BEGIN { print ($pred < 0.01) ? 41 : 5 }")
  meas=$("$bin/nnscaler" run step.mlir --inputs batch.safetensors --init-seed 0 --repeat "$repeat" \
    --timing serial -o /dev/null 2>&1 |
    sed -n 's/.*CPU time (serial timing): median \([0-9.]*\) s, fastest \([0-9.]*\) s.*/\1 \2/p')
  read -r median fastest <<< "$meas"
  printf '%-26s %12s %12s %12s %7s\n' "$preset batch $batch" "$pred" "$median" "$fastest" \
    "$(awk "BEGIN { printf \"%.2f\", $pred / $median }")"
done

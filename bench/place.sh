#!/usr/bin/env bash
# Placement speed: --place into 8 pipeline stages on llama3-70b and gpt3-175b (batch 8),
# Z3 (the default: memory caps, unsat cores) against the exact dynamic program in the same
# run, interleaved; medians of 5 of the place pass's own time (--mlir-timing) and their
# ratio, and whether both found the same slowest stage.
#   bench/place.sh [NNSCALER_OPT]      (default: this tree's release build)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
opt=${1:-$root/target/release/nnscaler-opt}
cli=$(dirname "$opt")/nnscaler
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
median() { sort -n | sed -n 3p; }
pass_time() { "$opt" "--place=stages=8 $1" --mlir-timing "$2" -o "$work/out.mlir" 2>&1 | awk '$NF == "place" { print $1 }'; }
balance() { "$opt" "--place=stages=8 $1" "$2" -o "$work/out.mlir" 2>&1 | grep -o 'slowest / mean = [0-9.]*'; }
for preset in llama3-70b gpt3-175b; do
  "$cli" import --preset "$preset" --batch 8 -o "$work/m.mlir"
  z=(); d=()
  for _ in 1 2 3 4 5; do
    z+=("$(pass_time solver=z3 "$work/m.mlir")")
    d+=("$(pass_time solver=dp "$work/m.mlir")")
  done
  mz=$(printf '%s\n' "${z[@]}" | median); md=$(printf '%s\n' "${d[@]}" | median)
  printf '%-11s z3 %7.3f s   dp %7.3f s   z3/dp %.2f   z3: %s   dp: %s\n' "$preset" "$mz" "$md" \
    "$(echo "$mz / $md" | bc -l)" "$(balance solver=z3 "$work/m.mlir")" "$(balance solver=dp "$work/m.mlir")"
done

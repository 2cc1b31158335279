#!/usr/bin/env bash
# Compile speed, A against B in one run: the whole partitioning pipeline on llama3-70b and
# gpt3-175b (batch 8, dp=8 x tp=8), runs interleaved, medians of 5 and their ratio.
#   bench/compile.sh BASE_NNSCALER_OPT [NEW_NNSCALER_OPT]
# e.g. build a base commit in a worktree with CARGO_TARGET_DIR=/tmp/base-target and pass
# /tmp/base-target/release/nnscaler-opt; NEW defaults to this tree's release build.
set -euo pipefail
base=${1:?usage: bench/compile.sh BASE_NNSCALER_OPT [NEW_NNSCALER_OPT]}
root=$(cd "$(dirname "$0")/.." && pwd)
new=${2:-$root/target/release/nnscaler-opt}
cli=$(dirname "$new")/nnscaler
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pipeline=(--autodiff "--plan=dp-megatron dp=8 tp=8" --propagate-layouts --split-tensor --lower-relayouts --localize)
median() { sort -n | sed -n 3p; }
seconds() { local s e; s=$(date +%s.%N); "$@" > /dev/null; e=$(date +%s.%N); echo "$e - $s" | bc; }
for preset in llama3-70b gpt3-175b; do
  "$cli" import --preset "$preset" --batch 8 -o "$work/m.mlir"
  a=(); b=()
  for _ in 1 2 3 4 5; do
    a+=("$(seconds "$base" "${pipeline[@]}" "$work/m.mlir" -o "$work/a.mlir")")
    b+=("$(seconds "$new" "${pipeline[@]}" "$work/m.mlir" -o "$work/b.mlir")")
  done
  ma=$(printf '%s\n' "${a[@]}" | median); mb=$(printf '%s\n' "${b[@]}" | median)
  printf '%-11s base %6.3f s   new %6.3f s   ratio %.3f\n' "$preset" "$ma" "$mb" "$(echo "$mb / $ma" | bc -l)"
done

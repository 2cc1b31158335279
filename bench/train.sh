#!/usr/bin/env bash
# Training speed, nnscaler against PyTorch in the same run: the nanoGPT CPU config
# (examples/nanogpt/cpu.toml: 4 layers, 4 heads, width 128, block 64, batch 12, AdamW,
# clipping), single thread, STEPS steps (default 100) each, runs interleaved 3 times;
# medians of tokens/s, the ratio of step times (nnscaler / PyTorch: <= 1 means nnscaler is
# at least as fast), and peak memory (max RSS).
#   bench/train.sh DATA_DIR [STEPS]   (DATA_DIR from nnscaler data prepare-char)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
data=$(cd "${1:?usage: bench/train.sh DATA_DIR [STEPS]}" && pwd)
steps=${2:-100}
bin=$root/target/release/nnscaler
py=${NNSCALER_PYTHON:-/usr/bin/python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
median() { sort -n | sed -n 2p; }
a=(); b=(); ma=(); mb=()
for _ in 1 2 3; do
  out=$(cd "$work" && /usr/bin/time -f "rss %M" "$bin" train --config "$root/examples/nanogpt/cpu.toml" \
    --set data.dir="\"$data\"" --set train.steps="$steps" --set train.eval_every=0 --set train.eval_batches=1 \
    --set train.log='"b.jsonl"' --set train.curve='"b.svg"' --set checkpoint.dir='"ck"' --set checkpoint.every="$steps" 2>&1)
  a+=("$(grep -o '"tokens_per_s":[0-9.]*' "$work/b.jsonl" | cut -d: -f2 | sort -n | sed -n "$((steps / 2))p")")
  ma+=("$(echo "$out" | grep -o 'rss [0-9]*' | cut -d' ' -f2)")
  out=$(/usr/bin/time -f "rss %M" "$py" "$root/bench/train_torch.py" "$data" "$steps" 2>&1)
  b+=("$(echo "$out" | grep -o 'tokens/s [0-9]*' | cut -d' ' -f2)")
  mb+=("$(echo "$out" | grep -o 'rss [0-9]*' | cut -d' ' -f2)")
done
na=$(printf '%s\n' "${a[@]}" | median); nb=$(printf '%s\n' "${b[@]}" | median)
ra=$(printf '%s\n' "${ma[@]}" | median); rb=$(printf '%s\n' "${mb[@]}" | median)
printf 'nnscaler %8.0f tokens/s (max RSS %d MiB)\npytorch  %8.0f tokens/s (max RSS %d MiB)\nnnscaler / pytorch step time %.2f\n' \
  "$na" "$((ra / 1024))" "$nb" "$((rb / 1024))" "$(echo "$nb / $na" | bc -l)"

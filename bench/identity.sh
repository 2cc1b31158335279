#!/usr/bin/env bash
# Byte-identity of the compiler's outputs, A against B: the refactoring steps of the
# architecture issue must not change one byte of what the tools print or write.
#   bench/identity.sh BASE_BIN_DIR [NEW_BIN_DIR]
# BIN_DIR holds nnscaler and nnscaler-opt (release builds); NEW defaults to this tree's
# target/release. Build a base commit in a worktree, e.g.
#   git worktree add /tmp/base HEAD~1 && (cd /tmp/base && CARGO_TARGET_DIR=/tmp/base-target \
#     cargo build --release --bin nnscaler --bin nnscaler-opt)
#   bench/identity.sh /tmp/base-target/release
# Runs the same commands with each (the zoo's small models under every policy, with the
# optimizer, through localization, and --print-stats; every pipeline schedule; compiled
# artifacts of training steps, f32 and bf16, less their host kernels' linker bytes;
# llama3-70b and gpt3-175b at dp=8 x tp=8; nnscaler plan's choices and scores),
# each command's stdout, stderr, exit status and output files kept, then compares the two
# trees: prints how many outputs agree, and the ones that differ (exit 1).
set -uo pipefail
base=${1:?usage: bench/identity.sh BASE_BIN_DIR [NEW_BIN_DIR]}
root=$(cd "$(dirname "$0")/.." && pwd)
new=${2:-$root/target/release}
for d in "$base" "$new"; do
  for b in nnscaler nnscaler-opt; do
    [ -x "$d/$b" ] || { echo "identity: no $d/$b" >&2; exit 2; }
  done
done
base=$(cd "$base" && pwd)
new=$(cd "$new" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# One case: NAME, then the command (nnscaler or nnscaler-opt first) with OUT standing for
# the case's output file. Both trees run it in their own directory.
cases=()
add() { cases+=("$(printf '%q ' "$@")"); }

pipeline=(--propagate-layouts --split-tensor --lower-relayouts --localize)
add opt.help nnscaler-opt --help
add opt.list-passes nnscaler-opt --list-passes
add cli.help nnscaler --help
add cli.presets nnscaler presets
for preset in mlp-tiny gpt-tiny nanogpt-cpu llama-tiny; do
  add "$preset.import" nnscaler import --preset "$preset" -o OUT
  for plan in "dp dp=2" "megatron tp=2" "dp-megatron dp=2 tp=2" "megatron-sp tp=2" \
    "dp-megatron-sp dp=2 tp=2" "tp-search dp=1 tp=2 cluster=cpu" "dp dp=2 zero=1" \
    "dp dp=2 zero=3" "auto cluster=dgx-h100 devices=8 max_pp=1"; do
    tag=$(echo "$plan" | tr ' =' '_-')
    add "$preset.$tag.localized" nnscaler-opt --autodiff --optimizer "--plan=$plan" "${pipeline[@]}" \
      "IN:$preset.import" -o OUT
    add "$preset.$tag.stats" nnscaler-opt --autodiff --optimizer "--plan=$plan" \
      --print-stats=cluster=dgx-h100 "IN:$preset.import" -o OUT
  done
done
for preset in gpt-tiny llama-tiny; do
  for s in gpipe 1f1b interleaved zb-h1 zb-v; do
    stages=2
    [ "$s" = zb-v ] || [ "$s" = interleaved ] && stages=4
    add "$preset.pp-$s" nnscaler-opt --autodiff --place=stages=$stages \
      "--plan=dp dp=1 pp=2 microbatches=2 schedule=$s" --split-tensor --schedule \
      --lower-relayouts --localize "IN:$preset.import" -o OUT
  done
done
# Compiled artifacts (PTX, host kernels, launch and memory plans) of training steps, f32
# and mixed precision.
add gpt-tiny.step nnscaler-opt --autodiff --optimizer "IN:gpt-tiny.import" -o OUT
add gpt-tiny.step.nnsx nnscaler compile "IN:gpt-tiny.step" -o OUT
add gpt-tiny.bf16 nnscaler-opt --autocast=bf16 --autodiff --optimizer "IN:gpt-tiny.import" -o OUT
add gpt-tiny.bf16.nnsx nnscaler compile "IN:gpt-tiny.bf16" -o OUT
add nanogpt-cpu.bf16 nnscaler-opt --autocast=bf16 --autodiff --optimizer "IN:nanogpt-cpu.import" -o OUT
add nanogpt-cpu.bf16.nnsx nnscaler compile "IN:nanogpt-cpu.bf16" -o OUT
# The CPU runtime's results (its kernels, bit for bit): a step of each small model with its
# gradients, mixed precision with the optimizer, and a localized dp2 x tp2 step on 4
# simulated devices.
for preset in mlp-tiny gpt-tiny nanogpt-cpu llama-tiny; do
  add "$preset.batch" nnscaler data random "IN:$preset.import" --seed 3 -o OUT
  add "$preset.run" nnscaler run --autodiff "IN:$preset.import" --inputs "IN:$preset.batch" \
    --init-seed 1 -o OUT
done
for preset in gpt-tiny llama-tiny; do
  add "$preset.bf16.step" nnscaler-opt --autocast=bf16 --autodiff --optimizer "IN:$preset.import" -o OUT
  add "$preset.bf16.batch" nnscaler data random "IN:$preset.bf16.step" --seed 3 --step 2 -o OUT
  add "$preset.bf16.run" nnscaler run "IN:$preset.bf16.step" --inputs "IN:$preset.bf16.batch" \
    --init-seed 1 -o OUT
  add "$preset.dp2tp2.run" nnscaler run --devices 4 "IN:$preset.dp-megatron_dp-2_tp-2.localized" \
    --inputs "IN:$preset.bf16.batch" --init-seed 1 -o OUT
done
for preset in llama3-70b gpt3-175b; do
  add "$preset.import" nnscaler import --preset "$preset" --batch 8 -o OUT
  add "$preset.dp8tp8" nnscaler-opt --autodiff "--plan=dp-megatron dp=8 tp=8" "${pipeline[@]}" \
    "IN:$preset.import" -o OUT
  add "$preset.dp8tp8.stats" nnscaler-opt --autodiff "--plan=dp-megatron dp=8 tp=8" \
    --print-stats=cluster=dgx-h100 "IN:$preset.import" -o OUT
  add "$preset.plan" nnscaler plan "IN:$preset.import" --cluster dgx-h100 --devices 64 --json
  add "$preset.megatron" nnscaler plan "IN:$preset.import" --cluster dgx-a100 --devices 64 --compare-megatron
done

run_all() {
  local bin=$1 dir=$2
  mkdir -p "$dir"
  for c in "${cases[@]}"; do
    eval "set -- $c"
    local name=$1 tool=$2
    shift 2
    local args=()
    for a in "$@"; do
      case $a in
        OUT) args+=("$dir/$name.out") ;;
        IN:*) args+=("$dir/${a#IN:}.out") ;;
        *) args+=("$a") ;;
      esac
    done
    (cd "$dir" && "$bin/$tool" "${args[@]}" > "$name.stdout" 2> "$name.stderr"; echo $? > "$name.status")
    # Paths and timings differ between the trees: the directory is written as DIR, and
    # times ("in 0.12 s", "12.3 ms" of compiling) are left out of the comparison.
    # An artifact's host kernels come from the system linker (bytes that may vary between
    # machines and toolchains) and its header names the source by path: compared are the
    # header (less that section, the source's directory) and the PTX.
    case $name in
      *.nnsx) [ -s "$dir/$name.out" ] && python3 -c '
import json, struct, sys
p = sys.argv[1]
raw = open(p, "rb").read()
(n,) = struct.unpack("<Q", raw[8:16])
h = json.loads(raw[24:24 + n])
ptx = next(s for s in h["sections"] if s["name"] == "ptx")
body = raw[24 + n + ptx["offset"]:24 + n + ptx["offset"] + ptx["bytes"]]
h["sections"] = [s for s in h["sections"] if s["name"] != "host.so"]
h["source"] = h["source"].rsplit("/", 1)[-1]
open(p, "wb").write(json.dumps(h, sort_keys=True).encode() + b"\n" + body)
' "$dir/$name.out" ;;
    esac
    sed -i -E -e "s#$dir#DIR#g" -e 's/ in [0-9.]+ s\b/ in T s/g' -e 's/\([0-9.]+ s\)/(T s)/g' \
      -e 's/"search_seconds": [0-9.e-]+/"search_seconds": T/' -e 's/[0-9.]+ s in all/T s in all/' \
      "$dir/$name.stdout" "$dir/$name.stderr"
  done
}
echo "identity: ${#cases[@]} cases with $base, then with $new" >&2
run_all "$base" "$work/a"
run_all "$new" "$work/b"
total=$(find "$work/a" -type f | wc -l)
failed=$(grep -lv '^0$' "$work"/b/*.status | wc -l)
[ "$failed" -eq 0 ] || echo "identity: $failed commands exit non-zero (compared all the same): $(grep -lv '^0$' "$work"/b/*.status | xargs -n1 basename | sed 's/\.status$//' | tr '\n' ' ')"
if diff -rq "$work/a" "$work/b" > "$work/diff.txt"; then
  echo "identity: $total outputs of ${#cases[@]} commands byte-identical ($base vs $new)"
  exit 0
fi
echo "identity: $(wc -l < "$work/diff.txt") of $total outputs differ:"
sed "s#$work/##g" "$work/diff.txt"
while read -r _ a _ b _; do
  case $a in *.stdout|*.stderr|*.status) diff "$a" "$b" | head -5 ;; esac
done < "$work/diff.txt"
exit 1

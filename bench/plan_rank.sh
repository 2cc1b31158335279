#!/usr/bin/env bash
# The plan search's ranking against measurement (issue 14): calibrate this CPU by
# microbenchmarks (nnscaler calibrate), let `nnscaler plan` rank plans of a model for N
# simulated devices, apply each ranked plan with the flags it prints, time it with
# `nnscaler run --devices N --repeat R` (the simulated devices' own time), and print
# predicted and measured step times, the median and the fastest run, with Spearman's rank
# correlation between the prediction and each, and with the measured times taken round by
# round relative to the round's median plan (the host's drift between rounds taken out),
# and how well the measurements rank the plans against themselves (split halves of the
# rounds): the noise's ceiling on rho.
# TIMING is how the simulated devices are timed (nnscaler run --timing, and the
# calibration's network with it): serial (they take
# turns on one core, each timed by its thread's CPU time on a virtual clock: steady on a
# busy machine, any number of devices) or wall (a thread each at once: give it a machine
# with at least N quiet cores).
#   bench/plan_rank.sh [PRESET BATCH DEVICES PLANS REPEAT ROUNDS TIMING]
#   (default: nanogpt-cpu 8 2 12 9 5 serial)
# With KEEP=DIR the calibration, the model, the plans (pN.mlir, plans.txt) and the times
# are left in DIR (created) for a look at one plan (nnscaler run --profile=DIR/cpu.toml).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$root/target/release
preset=${1:-nanogpt-cpu}
batch=${2:-8}
devices=${3:-2}
plans=${4:-12}
repeat=${5:-9}
rounds=${6:-5}
timing=${7:-serial}
cargo build --release -q --bin nnscaler --bin nnscaler-opt --manifest-path "$root/Cargo.toml"
if [ -n "${KEEP:-}" ]; then
  mkdir -p "$KEEP"
  work=$(cd "$KEEP" && pwd)
  rm -f "$work"/t*.txt
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
cd "$work"
"$bin/nnscaler" calibrate --device cpu --timing "$timing" -o cpu.toml > /dev/null
case $preset in
  llama*) family=llama ;;
  mlp*) family=mlp ;;
  *) family=gpt ;;
esac
"$bin/nnscaler" import "$family" --preset "$preset" --batch "$batch" -o m.mlir
"$bin/nnscaler-opt" --autodiff --optimizer m.mlir -o step.mlir
"$bin/nnscaler" data random step.mlir -o batch.safetensors
python3 - batch.safetensors <<'EOF'
# lr and step as the optimizer expects them (a random batch draws them at random).
import json, struct, sys
path = sys.argv[1]
raw = open(path, 'rb').read()
n = struct.unpack('<Q', raw[:8])[0]
head = json.loads(raw[8:8 + n])
data = bytearray(raw[8 + n:])
for name, value in (('lr', 1e-3), ('step', 3.0)):
    lo, _ = head[name]['data_offsets']
    data[lo:lo + 4] = struct.pack('<f', value)
open(path, 'wb').write(raw[:8 + n] + bytes(data))
EOF
"$bin/nnscaler" plan m.mlir --cluster cpu.toml --devices "$devices" --top 199 --json > plan.json 2> /dev/null
# PLANS plans spread evenly over the ranking (the best among them).
python3 - plan.json "$plans" > plans.txt <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
ranked = [dict(j['best'], flags=j['flags'])] + j['alternatives']
want = int(sys.argv[2])
step = max(1, len(ranked) // want)
for e in ranked[::step][:want]:
    c = e['config']
    print('%.6e\t%s\tdp=%d tp=%d%s pp=%d mb=%dx%d %s %s z%d' % (
        e['seconds'], e['flags'], c['dp'], c['tp'],
        '' if c['tp'] == 1 else '(%s)' % c['tensor'], c['pp'], c['micro'], c['microbatches'],
        c['schedule'], c['recompute'], c['zero']))
EOF
# Apply every plan first, then time them in ROUNDS interleaved rounds (each plan's
# median over its REPEAT runs, then the median over rounds): a burst of load on the
# machine then touches every plan's rounds alike instead of one plan's only.
i=0
while IFS=$'\t' read -r pred flags name; do
  eval "\"$bin/nnscaler-opt\" $flags m.mlir -o p$i.mlir" 2> /dev/null
  i=$((i + 1))
done < plans.txt
n=$i
for round in $(seq "$rounds"); do
  for i in $(seq 0 $((n - 1))); do
    "$bin/nnscaler" run p$i.mlir --devices "$devices" --inputs batch.safetensors --init-seed 0 \
      --repeat "$repeat" --timing "$timing" -o /dev/null 2>&1 \
      | sed -n 's/.*simulated devices[^:]*: median \([0-9.]*\) s, fastest \([0-9.]*\) s.*/\1 \2/p' >> "t$i.txt"
  done
done
printf '%-48s %12s %12s %12s %8s\n' plan predicted median fastest pred/med
: > times.txt
i=0
while IFS=$'\t' read -r pred flags name; do
  meas=$(sort -g -k1 "t$i.txt" | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')
  fast=$(sort -g -k2 "t$i.txt" | awk 'NR == 1 { print $2 }')
  printf '%-48s %12.6f %12.6f %12.6f %8.2f\n' "$name" "$pred" "$meas" "$fast" \
    "$(awk "BEGIN { print $pred / $meas }")"
  echo "$pred $meas $fast $(awk '{ printf "%s ", $1 }' "t$i.txt")" >> times.txt
  i=$((i + 1))
done < plans.txt
python3 - times.txt <<'EOF'
import sys
rows = [tuple(map(float, l.split())) for l in open(sys.argv[1]) if l.strip()]
def ranks(xs):
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r
def rho(xs, ys):
    p, m = ranks(xs), ranks(ys)
    n = len(xs)
    mp, mm = sum(p) / n, sum(m) / n
    cov = sum((a - mp) * (b - mm) for a, b in zip(p, m))
    sd = (sum((a - mp) ** 2 for a in p) * sum((b - mm) ** 2 for b in m)) ** 0.5
    return cov / sd if sd else 1.0
n = len(rows)
pred = [r[0] for r in rows]
for k, what in ((1, 'median'), (2, 'fastest')):
    ratio = sorted(r[0] / r[k] for r in rows)[n // 2]
    print('plans %d, measured by the %s: Spearman rho %.3f, median predicted / measured %.2f'
          % (n, what, rho(pred, [r[k] for r in rows]), ratio))
# The host's speed drifts between rounds and moves every plan of a round alike: each
# plan's time in a round over that round's median plan, then the median over rounds,
# ranks the plans with that common factor taken out.
def median(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2
per_round = [r[3:] for r in rows]
rounds = min(len(p) for p in per_round)
if rounds > 1:
    centre = [median([p[j] for p in per_round]) for j in range(rounds)]
    rel = [median([p[j] / centre[j] for j in range(rounds)]) for p in per_round]
    print('plans %d, measured by each round over its median plan (%d rounds): Spearman rho %.3f'
          % (n, rounds, rho(pred, rel)))
# The noise's ceiling: the measurements against themselves. For every split of the rounds
# into two halves, rho between the halves' round-normalised medians, and the prediction's
# rho against each half. A prediction cannot be expected to rank the plans more alike to
# the measurements than the measurements rank themselves.
if rounds > 2:
    import itertools
    norm = [[p[j] / centre[j] for j in range(rounds)] for p in per_round]
    halves, against = [], []
    for a in itertools.combinations(range(rounds), rounds // 2):
        b = [j for j in range(rounds) if j not in a]
        ha = [median([r[j] for j in a]) for r in norm]
        hb = [median([r[j] for j in b]) for r in norm]
        halves.append(rho(ha, hb))
        against += [rho(pred, ha), rho(pred, hb)]
    print('split halves of the rounds (%d splits): the measurements against themselves rho %.3f '
          '(%.3f-%.3f), the prediction against a half %.3f (medians)'
          % (len(halves), median(halves), min(halves), max(halves), median(against)))
EOF

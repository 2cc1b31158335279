#!/usr/bin/env bash
# The plan search's fast composition against the cost model of the programs it picks
# (issue 14): `nnscaler plan` scores each plan from per-layer profiles (stage costs, a
# simulated schedule, the gradient sync, the update); this compiles each of the PLANS best
# plans with the flags the search prints and predicts the compiled program with the same
# cluster (`nnscaler-opt --print-stats=cluster=...` for a plain step, `nnscaler
# schedule-report --cluster` for a pipelined one: its fragments, sends and each rank's own
# ops). Both sides are the same cost model, so the ratio measures what the search's
# composition misses, free of the machine's noise: it prints every plan's ratio, then the
# median and 90th percentile of |ratio - 1|, the largest, and how many plans fall outside
# 2% and 4%.
#   bench/search_vs_compiled.sh [PRESET BATCH DEVICES CLUSTER PLANS]
#   (default: nanogpt-cpu 8 4 cpu 100; BIN_DIR=DIR: another build's nnscaler and
#   nnscaler-opt, e.g. a base commit's, instead of building this tree's)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN_DIR:-$root/target/release}
preset=${1:-nanogpt-cpu}
batch=${2:-8}
devices=${3:-4}
cluster=${4:-cpu}
plans=${5:-100}
[ -n "${BIN_DIR:-}" ] || cargo build --release -q --bin nnscaler --bin nnscaler-opt --manifest-path "$root/Cargo.toml"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
case $cluster in
  */*|*.toml) cp "$cluster" "$work/cluster.toml"; cluster=cluster.toml ;;
esac
cd "$work"
case $preset in
  llama*) family=llama ;;
  mlp*) family=mlp ;;
  *) family=gpt ;;
esac
"$bin/nnscaler" import "$family" --preset "$preset" --batch "$batch" -o m.mlir
"$bin/nnscaler" plan m.mlir --cluster "$cluster" --devices "$devices" --top "$plans" --json \
  > plan.json 2> /dev/null
BIN=$bin CLUSTER=$cluster python3 - plan.json "$plans" <<'EOF'
import json, os, re, statistics, subprocess, sys
bin, cluster = os.environ['BIN'], os.environ['CLUSTER']
j = json.load(open(sys.argv[1]))
ranked = [dict(j['best'], flags=j['flags'])] + j['alternatives']
ratios = []
print('%-56s %12s %12s %7s' % ('plan', 'search', 'compiled', 'ratio'))
for e in ranked[:int(sys.argv[2])]:
    c = e['config']
    name = 'dp=%d tp=%d(%s) pp=%d mb=%dx%d %s %s z%d' % (
        c['dp'], c['tp'], c['tensor'], c['pp'], c['micro'], c['microbatches'],
        c['schedule'], c['recompute'], c['zero'])
    subprocess.run('"%s/nnscaler-opt" %s m.mlir -o p.mlir 2> /dev/null' % (bin, e['flags']),
                   shell=True, check=True)
    # A pipeline (or micro-batches on one stage): --schedule (the plan's chosen schedule)
    # or a --schedule-<name> flag makes per-rank programs.
    if re.search(r'--schedule(-|=|\s|$)', e['flags']):
        out = subprocess.run([bin + '/nnscaler', 'schedule-report', '--program', 'p.mlir',
                              '--cluster', cluster], capture_output=True, text=True,
                             check=True).stdout
        compiled = float(re.search(r'predicted step: ([0-9.]+) ms', out).group(1)) / 1e3
    else:
        out = subprocess.run([bin + '/nnscaler-opt', '--print-stats=cluster=' + cluster,
                              'p.mlir', '-o', '/dev/null'], capture_output=True, text=True,
                             check=True).stderr
        compiled = float(re.search(r'predicted time per run on [^:]*: ([0-9.]+) s',
                                   out).group(1))
    ratios.append(e['seconds'] / compiled)
    print('%-56s %9.3f ms %9.3f ms %7.3f' % (name, e['seconds'] * 1e3, compiled * 1e3,
                                              ratios[-1]), flush=True)
off = sorted(abs(r - 1) for r in ratios)
print('%d plans: |search / compiled - 1| median %.3f, 90th percentile %.3f, largest %.3f; '
      'outside 2%%: %d, outside 4%%: %d' % (
          len(off), statistics.median(off), off[int(0.9 * (len(off) - 1))], off[-1],
          sum(x > 0.02 for x in off), sum(x > 0.04 for x in off)))
EOF

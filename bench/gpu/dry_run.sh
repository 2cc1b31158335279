#!/usr/bin/env bash
# The device check's flow without a GPU: runs check.sh from a copy of the folder
# bench/gpu/prepare.sh made, with nnscaler-rt's CUDA backend replaced by its host backend
# (--backend cuda -> host, --ranks=streams|gpus -> --ranks), so the cases' files,
# arguments, tolerances and reference results are checked here before a GPU session
# spends its time on them. Skipped: the per-kernel comparison and the benchmarks (they
# need the GPU), the nanoGPT GPU-config and GEMM timings (far too slow on a CPU; their
# inputs are still drawn; so their profiles beside PyTorch's too), the PyTorch
# reference and the runtime's memory (they need CUDA); each says so.
#   bench/gpu/prepare.sh DIR && bench/gpu/dry_run.sh DIR
set -euo pipefail
src=$(cd "${1:?usage: bench/gpu/dry_run.sh PREPARED_DIR}" && pwd)
dry=$(mktemp -d)
trap 'rm -rf "$dry"' EXIT
cp -r "$src/." "$dry/"
cd "$dry"
mv nnscaler-rt nnscaler-rt.real
cat > nnscaler-rt <<'SHIM'
#!/usr/bin/env bash
args=()
files=()
prev=
for a in "$@"; do
  case $a in
    cuda) args+=(host) ;;
    --ranks=streams|--ranks=gpus) args+=(--ranks) ;;
    *) args+=("$a") ;;
  esac
  if [ "$prev" = --inputs ]; then files+=("$a"); fi
  prev=$a
done
# Too slow on a CPU: only check that the inputs given cover the program's.
case "${2:-}" in
  gpt2*.nnsx|attn-nanogpt*.nnsx|attn-gpt2*.nnsx|attn-tf32x3-*.nnsx|attn-bf16-nanogpt*.nnsx|attn-bf16-gpt2*.nnsx)
    # Their inputs are drawn on the GPU machine only (too large to draw here).
    echo "(dry run: running $2 skipped)"; exit 0 ;;
  gemm.nnsx|nanogpt-gpu*.nnsx)
    python3 "$(dirname "$0")/compare.py" covers "$2" "${files[@]}" || exit 1
    echo "(dry run: running $2 skipped)"; exit 0 ;;
esac
case "${1:-}" in compare|bench) echo "(dry run: nnscaler-rt $1 skipped)"; exit 0 ;; esac
# Training the nanoGPT GPU bundle takes hours on the host kernels: its files are checked.
case "${1:-} ${2:-}" in
  "train "*nanogpt-gpu.bundle)
    "$(dirname "$0")/nnscaler-rt.real" info "$2" > /dev/null || exit 1
    echo "(dry run: training $2 skipped; its files are good)"; exit 0 ;;
esac
exec "$(dirname "$0")/nnscaler-rt.real" "${args[@]}"
SHIM
cat > python-dry <<'SHIM'
#!/usr/bin/env bash
case "${1:-}" in
  torch_ref.py) echo "(dry run: torch_ref.py $2 skipped)"; exit 0 ;;
  torch_user.py) echo "(dry run: torch_user.py skipped)"; exit 0 ;;
  memory_reserve.py) echo "(dry run: memory_reserve.py skipped: it needs CUDA)"; exit 0 ;;
  importer.py|import_ref.py) echo "(dry run: $1 skipped: the model needs torch 2.x)"; exit 0 ;;
  torch_families.py) echo "(dry run: torch_families.py skipped)"; exit 0 ;;
  compare.py) if [ "${2:-}" = side ]; then echo "(dry run: compare.py side skipped: the steps it reads were not run)"; exit 0; fi ;;
esac
# Timing-only inputs too large to draw here (the runs they feed are skipped).
case "${1:-} ${2:-} ${3:-}" in
  "compare.py inputs attn-nanogpt.nnsx"|"compare.py inputs attn-gpt2.nnsx"|"compare.py params gpt2-step.nnsx"|"compare.py inputs attn-bf16-nanogpt.nnsx"|"compare.py inputs attn-bf16-gpt2.nnsx")
    echo "(dry run: compare.py $2 $3 skipped)"; exit 0 ;;
esac
exec python3 "$@"
SHIM
chmod +x nnscaler-rt python-dry
# No GPUs: nvidia-smi prints nothing, so the NCCL cases say they are skipped.
ln -s /bin/true nvidia-smi
PATH=$PWD:$PATH PYTHON=$PWD/python-dry ./check.sh
# train.sh: the bundle's files checked (training itself skipped).
PATH=$PWD:$PATH TRAIN_SECONDS=1 ./train.sh "$dry/train-out"

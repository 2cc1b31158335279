#!/usr/bin/env bash
# The GPU check, one command on a machine with an NVIDIA GPU, from the folder
# bench/gpu/prepare.sh made (nothing is built or downloaded here):
#   ./check.sh            (QUICK=1 ./check.sh: the correctness of gpt-tiny's step and of
#                          the attention kernels, and the timings against PyTorch, without
#                          the per-kernel comparison, the multi-device cases, what a user
#                          runs, the GEMM rate and the calibration benchmarks: a second run
#                          of a session, after a change, in about two minutes;
#                          BUDGET=SECONDS ./check.sh: the optional timings skipped once
#                          that many seconds have passed, see within() below)
# Prints: the GPU; per kernel, the GPU against the host kernels step by step
# (nnscaler-rt compare, on gpt-tiny's step and on any case that disagrees); per case,
# agreement of the CUDA backend with the CPU runtime (whole
# training steps, one device, dp2 x tp2 on 4 virtual devices, and a pp2 x dp2 x tp2 1F1B
# pipeline on 8, gpt-tiny's step in mixed precision; the same as ranks, a GPU each through
# NCCL, where the GPUs suffice, and a stream each on one GPU); the nanoGPT GPU-config
# step time against PyTorch eager on the same GPU, in fp32 and in mixed precision (bf16
# against torch.autocast); the tiled attention kernels against the CPU runtime and, alone,
# against PyTorch's scaled_dot_product_attention; GPT-2 124M's step against PyTorch; what a
# user runs instead (torch_user.py); the GEMM rate against torch.matmul; ncu's per-launch
# kernel times of the attention kernels and the nanoGPT steps (files in $OUT), by family;
# the steps' profiles by kernel family (nnscaler-rt run --profile: CUDA events per launch);
# the PyTorch importer on the GPU machine's torch 2.x (a GPT with
# F.scaled_dot_product_attention: its MLIR, parameters, batch and PyTorch's gradients to
# $OUT, for nnscaler run to check where nnscaler is); what the CUDA context, cuBLAS and an
# NCCL communicator hold and the allocator's margin
# in training (memory_reserve.py); and the calibration benchmarks' times
# (calib-timings.json, copied to $OUT when set).
set -uo pipefail
cd "$(dirname "$0")"
py=${PYTHON:-python3}
date -u '+%Y-%m-%d %H:%M UTC'
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
./nnscaler-rt --version
# cuBLAS: the system's, else PyTorch's wheel's (linked under the plain name nnscaler-rt
# looks for, next to its libcublasLt).
if ! ldconfig -p 2>/dev/null | grep -q 'libcublas\.so '; then
  so=$(find $("$py" -c 'import site; print(" ".join(site.getsitepackages()))') -name 'libcublas.so*' 2>/dev/null | head -1)
  if [ -n "$so" ]; then
    mkdir -p lib && ln -sf "$so" lib/libcublas.so
    export LD_LIBRARY_PATH="$PWD/lib:$(dirname "$so"):${LD_LIBRARY_PATH:-}"
  fi
fi
# NCCL (for --ranks): the system's, else PyTorch's wheel's, under the plain name.
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
  so=$(find $("$py" -c 'import site; print(" ".join(site.getsitepackages()))') -name 'libnccl.so*' 2>/dev/null | head -1)
  if [ -n "$so" ]; then
    mkdir -p lib && ln -sf "$so" lib/libnccl.so
    export LD_LIBRARY_PATH="$PWD/lib:${LD_LIBRARY_PATH:-}"
  fi
fi
status=0
# Everything printed also goes to check.log, which the summary below reads: in $OUT when
# the harness sets it, so that a run stopped at its time limit still brings it back whole.
log=${OUT:-.}/check.log
exec > >(tee "$log") 2>&1
# Per kernel: the GPU against the host kernels (which equal the CPU reference op by op),
# step by step, on gpt-tiny's training step; and on any case below whose results
# disagree, to name the first kernel that does.
quick=${QUICK:-}
# BUDGET=SECONDS: the optional timings (the knobs' sweeps, bf16 activations, CUDA graphs,
# GPT-2, what a user runs, the GEMM rate, ncu, the importer) are skipped once that many
# seconds have passed, each saying so, so that the correctness cases, the attention and
# nanoGPT timings, the summary and the calibration fit one device command's time limit.
within() {
  if [ -n "${BUDGET:-}" ] && [ "$SECONDS" -ge "$BUDGET" ]; then
    echo "== [${SECONDS} s] skipped (past BUDGET=$BUDGET s): $1"
    return 1
  fi
}
echo "== [${SECONDS} s] per kernel: gpt-tiny-step, GPU against the host kernels"
[ -n "$quick" ] || ./nnscaler-rt compare gpt-tiny-step.nnsx --inputs gpt-tiny-step.in.safetensors \
  --inputs gpt-tiny-step.params.safetensors || status=1
# bf16 results: cuBLAS's tensor cores sum in their own order, and a sum a rounding apart
# rounds to a neighbouring bf16 (2^-8 relative), so the bf16 step is held to 3e-2.
cases="gpt-tiny-step gpt-tiny-dptp gpt-tiny-pp nanogpt-cpu-step gpt-tiny-bf16-step gpt-tiny-bf16act-step"
[ -z "$quick" ] || cases="gpt-tiny-step gpt-tiny-bf16-step"
for c in $cases; do
  echo "== [${SECONDS} s] $c"
  tol=1e-4
  case $c in *bf16*) tol=3e-2 ;; esac
  if ./nnscaler-rt run "$c.nnsx" --backend cuda --repeat 3 --inputs "$c.in.safetensors" \
      --inputs "$c.params.safetensors" -o "$c.got.safetensors" \
      && "$py" compare.py close "$c.got.safetensors" "$c.want.safetensors" "$tol"; then
    :
  else
    status=1
    ./nnscaler-rt compare "$c.nnsx" --inputs "$c.in.safetensors" \
      --inputs "$c.params.safetensors" || true
  fi
done
# Ranks: a thread and a GPU per device, collectives and messages through NCCL (as many
# GPUs as devices; a case needing more is skipped and says so).
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
for spec in $([ -n "$quick" ] || echo gpt-tiny-step:1 gpt-tiny-dptp:4 gpt-tiny-pp:8); do
  c=${spec%%:*}; need=${spec##*:}
  echo "== [${SECONDS} s] $c as ranks (NCCL, $need GPU(s))"
  if [ "${gpus:-0}" -lt "$need" ]; then
    echo "skipped: $c needs $need GPUs, this machine has ${gpus:-0}"
    continue
  fi
  ./nnscaler-rt run "$c.nnsx" --backend cuda --ranks --repeat 3 --inputs "$c.in.safetensors" \
      --inputs "$c.params.safetensors" -o "$c.ranks.safetensors" \
    && "$py" compare.py close "$c.ranks.safetensors" "$c.want.safetensors" 1e-4 || status=1
done
# Ranks as streams: every device a stream and a thread of its own on GPU 0 (any number of
# devices), collectives by device copies and reducer kernels ordered by events.
for c in $([ -n "$quick" ] || echo gpt-tiny-dptp gpt-tiny-pp); do
  echo "== [${SECONDS} s] $c as ranks (a stream per device on one GPU)"
  ./nnscaler-rt run "$c.nnsx" --backend cuda --ranks=streams --repeat 3 --inputs "$c.in.safetensors" \
      --inputs "$c.params.safetensors" -o "$c.streams.safetensors" \
    && "$py" compare.py close "$c.streams.safetensors" "$c.want.safetensors" 1e-4 || status=1
done
# The tiled attention kernels (FlashAttention-2 form: online softmax, nothing per key kept)
# against the CPU runtime at head width 64, several tiles: each op within 1e-5 of the
# tensor's scale.
echo "== [${SECONDS} s] attention kernels (width 64; causal T300, grouped heads T130 x 200) against the CPU runtime"
if ./nnscaler-rt run attn-check.nnsx --backend cuda --repeat 3 --inputs attn-check.in.safetensors \
    --inputs attn-check.params.safetensors -o attn-check.got.safetensors \
  && "$py" compare.py close attn-check.got.safetensors attn-check.want.safetensors 1e-5; then
  :
else
  status=1
fi
echo "== [${SECONDS} s] the same with f32 attention on tensor cores (NNSCALER_ATTN_F32=tf32x3: three TF32 products)"
if ./nnscaler-rt run attn-check-tf32x3.nnsx --backend cuda --repeat 3 --inputs attn-check.in.safetensors \
    --inputs attn-check.params.safetensors -o attn-check-tf32x3.got.safetensors \
  && "$py" compare.py close attn-check-tf32x3.got.safetensors attn-check.want.safetensors 1e-5; then
  :
else
  status=1
fi
# The tensor-core kernels kernel by kernel against the host kernels (the same algorithm,
# emulated lane by lane; each kernel from the host's inputs): f32 as three TF32 products
# within 1e-4; bf16 within 1e-2 (a sum in another order may round to the neighbouring
# bf16, 2^-8 of an element), and the bf16 step against the CPU runtime within 3e-2.
echo "== [${SECONDS} s] per kernel: attention on tensor cores (attn-check-tf32x3; attn-bf16, a bf16 training step), GPU against the host kernels"
./nnscaler-rt compare attn-check-tf32x3.nnsx --inputs attn-check.in.safetensors \
  --inputs attn-check.params.safetensors || status=1
./nnscaler-rt compare attn-bf16.nnsx --tolerance 1e-2 --inputs attn-bf16.in.safetensors \
  --inputs attn-bf16.params.safetensors || status=1
if ./nnscaler-rt run attn-bf16.nnsx --backend cuda --repeat 3 --inputs attn-bf16.in.safetensors \
    --inputs attn-bf16.params.safetensors -o attn-bf16.got.safetensors \
  && "$py" compare.py close attn-bf16.got.safetensors attn-bf16.want.safetensors 3e-2; then
  :
else
  status=1
fi
# Our profile by family of work beside PyTorch's time for the same work on this GPU
# (torch_families.py: each family timed alone at the model's shapes), with the ratios.
side() {
  local spec="$1 $2 $3 $4 $5 $6" prof=$7 dt=${8:-}
  echo "-- by family, beside PyTorch (eager${dt:+, $dt})"
  "$py" torch_families.py $spec $dt > "$prof.torch.txt" 2>&1 || { cat "$prof.torch.txt"; status=1; return; }
  "$py" compare.py side "$prof" "$prof.torch.txt" || status=1
}
# Attention alone against PyTorch's scaled_dot_product_attention on the same GPU.
for spec in nanogpt:64:6:256 gpt2:8:12:1024; do
  IFS=: read -r c b h t <<< "$spec"
  echo "== [${SECONDS} s] attention alone, $c shape (B$b H$h T$t d64, causal, fp32): forward, then forward + backward"
  "$py" compare.py inputs "attn-$c.nnsx" "attn-$c.in.safetensors" || status=1
  ./nnscaler-rt run "attn-$c-fwd.nnsx" --backend cuda --repeat 20 --inputs "attn-$c.in.safetensors" -o /dev/null || status=1
  ./nnscaler-rt run "attn-$c.nnsx" --backend cuda --repeat 20 --inputs "attn-$c.in.safetensors" -o /dev/null || status=1
  echo "-- the same on tensor cores as three TF32 products (NNSCALER_ATTN_F32=tf32x3: forward and backward)"
  ./nnscaler-rt run "attn-tf32x3-$c-fwd.nnsx" --backend cuda --repeat 20 --inputs "attn-$c.in.safetensors" -o /dev/null || status=1
  ./nnscaler-rt run "attn-tf32x3-$c.nnsx" --backend cuda --repeat 20 --inputs "attn-$c.in.safetensors" -o /dev/null || status=1
  "$py" torch_ref.py attn "$b" "$h" "$t" 64 || status=1
  "$py" torch_ref.py attn "$b" "$h" "$t" 64 bf16 || status=1
  echo "-- bf16 on tensor cores: a training step of the attention alone (autocast), the forward's key tiles in two buffers (cp.async; the default), then (nanoGPT's shape) in one (NNSCALER_ATTN_BUFFERS=1)"
  "$py" compare.py inputs "attn-bf16-$c.nnsx" "attn-bf16-$c.in.safetensors" || status=1
  for v in "" -b1; do
    [ -e "attn-bf16-$c$v.nnsx" ] || continue
    ./nnscaler-rt run "attn-bf16-$c$v.nnsx" --backend cuda --repeat 20 --profile --inputs "attn-bf16-$c.in.safetensors" \
      -o /dev/null > "attn-bf16-$c$v.profile.txt" 2>&1 || status=1
    grep -E '^ran |^attention' "attn-bf16-$c$v.profile.txt" | sed "s/^/bf16${v:- two buffers}: /" || true
  done
done
echo "== [${SECONDS} s] nanogpt GPU config (6 layers, 6 heads, 384 wide, block 256, batch 64; fp32)"
"$py" compare.py params nanogpt-gpu-step.nnsx nanogpt-gpu-step.params.safetensors
./nnscaler-rt run nanogpt-gpu-step.nnsx --backend cuda --repeat 5 --profile --inputs nanogpt-gpu-step.in.safetensors \
  --inputs nanogpt-gpu-step.params.safetensors -o /dev/null > nanogpt.profile.txt 2>&1 || status=1
cat nanogpt.profile.txt
"$py" torch_ref.py step 6 6 384 256 64 65 || status=1
side 6 6 384 256 64 65 nanogpt.profile.txt
if within "the knobs' sweeps (row teams, tf32x3, cublasSgemm, no cuBLASLt)"; then
  # The row teams' size (elements a lane aims for; the step above is 1): the whole step's
  # time and its row families, on the same inputs, to choose the default from.
  echo "== [${SECONDS} s] nanogpt GPU config, row teams swept (NNSCALER_ROW_ELEMS 2, 4, 8, 16; the step above: 1)"
  for e in 2 4 8 16; do
    ./nnscaler-rt run "nanogpt-gpu-step-rows$e.nnsx" --backend cuda --repeat 5 --profile --inputs nanogpt-gpu-step.in.safetensors \
      --inputs nanogpt-gpu-step.params.safetensors -o /dev/null > "rows$e.profile.txt" 2>&1 || status=1
    grep -E '^ran |^(layer_norm|cross_entropy|softmax|log_softmax|sum|mean)[a-z_]* ' "rows$e.profile.txt" | sed "s/^/rows$e: /" || true
  done
  # f32 attention on tensor cores as three TF32 products (NNSCALER_ATTN_F32=tf32x3):
  # the step and its attention families, to choose the default.
  echo "== [${SECONDS} s] nanogpt GPU config, f32 attention on tensor cores (NNSCALER_ATTN_F32=tf32x3; the step above: register tiles)"
  ./nnscaler-rt run nanogpt-gpu-step-tf32x3.nnsx --backend cuda --repeat 5 --profile --inputs nanogpt-gpu-step.in.safetensors \
    --inputs nanogpt-gpu-step.params.safetensors -o /dev/null > tf32x3.profile.txt 2>&1 || status=1
  grep -E '^ran |^attention' tf32x3.profile.txt | sed "s/^/tf32x3: /" || true
  # Single products through cublasSgemm instead of the strided-batched call with one batch
  # (NNSCALER_CUBLAS=plain): the step and its matrix-product families, to choose the default.
  echo "== [${SECONDS} s] nanogpt GPU config, single products through cublasSgemm (NNSCALER_CUBLAS=plain)"
  NNSCALER_CUBLAS=plain ./nnscaler-rt run nanogpt-gpu-step.nnsx --backend cuda --repeat 5 --profile --inputs nanogpt-gpu-step.in.safetensors \
    --inputs nanogpt-gpu-step.params.safetensors -o /dev/null > plain.profile.txt 2>&1 || status=1
  grep -E '^nnscaler-rt: matrix|^ran |^(linear|linear_gemm|linear_weight_grad|matmul) ' plain.profile.txt | sed "s/^/plain: /" || true
  # Biases by their element-wise kernels after cuBLAS (NNSCALER_CUBLASLT=0) instead of
  # cuBLASLt's epilogue (the step above): the step and its product and bias families.
  echo "== [${SECONDS} s] nanogpt GPU config, biases by their kernels after cuBLAS (NNSCALER_CUBLASLT=0; the step above: cuBLASLt's epilogue)"
  NNSCALER_CUBLASLT=0 ./nnscaler-rt run nanogpt-gpu-step.nnsx --backend cuda --repeat 5 --profile --inputs nanogpt-gpu-step.in.safetensors \
    --inputs nanogpt-gpu-step.params.safetensors -o /dev/null > nolt.profile.txt 2>&1 || status=1
  grep -E '^nnscaler-rt: matrix|^ran |^(linear|linear_bias|linear_weight_grad|matmul) ' nolt.profile.txt | sed "s/^/no cuBLASLt: /" || true
fi
echo "== [${SECONDS} s] nanogpt GPU config in mixed precision (bf16 products, 2-byte bf16 buffers; PyTorch: autocast bf16)"
# The same parameters and optimizer state (f32 master weights: the same inputs).
cp nanogpt-gpu-step.params.safetensors nanogpt-gpu-bf16-step.params.safetensors
./nnscaler-rt run nanogpt-gpu-bf16-step.nnsx --backend cuda --repeat 5 --profile --inputs nanogpt-gpu-bf16-step.in.safetensors \
  --inputs nanogpt-gpu-bf16-step.params.safetensors -o /dev/null > nanogpt-bf16.profile.txt 2>&1 || status=1
cat nanogpt-bf16.profile.txt
"$py" torch_ref.py step 6 6 384 256 64 65 bf16 || status=1
side 6 6 384 256 64 65 nanogpt-bf16.profile.txt bf16
if within "bf16 activations, CUDA graphs, TF32"; then
  echo "== [${SECONDS} s] nanogpt GPU config with every activation in bf16 (--autocast=\"bf16 activations=bf16\"; PyTorch: autocast bf16 above)"
  cp nanogpt-gpu-step.params.safetensors nanogpt-gpu-act-step.params.safetensors
  ./nnscaler-rt run nanogpt-gpu-act-step.nnsx --backend cuda --repeat 5 --profile --inputs nanogpt-gpu-act-step.in.safetensors \
    --inputs nanogpt-gpu-act-step.params.safetensors -o /dev/null > nanogpt-act.profile.txt 2>&1 || status=1
  cat nanogpt-act.profile.txt
  echo "-- by family, beside PyTorch (eager, bf16; its families timed above)"
  "$py" compare.py side nanogpt-act.profile.txt nanogpt-bf16.profile.txt.torch.txt || status=1
  # Launch overhead: the same steps captured once as CUDA graphs and replayed (--graph; the
  # summary's "graph" column), and the fp32 step with TF32 products (--matmul-precision
  # high, as torch_user.py's TF32 row).
  echo "== [${SECONDS} s] nanogpt GPU config as CUDA graphs (--graph), and with TF32 products (--matmul-precision high)"
  for s in nanogpt-gpu-step nanogpt-gpu-bf16-step nanogpt-gpu-act-step; do
    ./nnscaler-rt run "$s.nnsx" --backend cuda --repeat 5 --graph --inputs "$s.in.safetensors" \
      --inputs "$s.params.safetensors" -o /dev/null 2>&1 | sed 's/^/graph: /' || status=1
  done
  ./nnscaler-rt run nanogpt-gpu-step.nnsx --backend cuda --repeat 5 --matmul-precision high --inputs nanogpt-gpu-step.in.safetensors \
    --inputs nanogpt-gpu-step.params.safetensors -o /dev/null 2>&1 | sed 's/^/tf32: /' || status=1
fi
if within "GPT-2 124M, what a user runs, the GEMM rate"; then
  echo "== [${SECONDS} s] GPT-2 124M (12 layers, 12 heads, 768 wide, block 1024, batch 8, vocab 50257; fp32, then mixed precision)"
  "$py" compare.py params gpt2-step.nnsx gpt2-step.params.safetensors
  ./nnscaler-rt run gpt2-step.nnsx --backend cuda --repeat 5 --profile --inputs gpt2-step.in.safetensors \
    --inputs gpt2-step.params.safetensors -o /dev/null > gpt2.profile.txt 2>&1 || status=1
  cat gpt2.profile.txt
  "$py" torch_ref.py step 12 12 768 1024 8 50257 || status=1
  side 12 12 768 1024 8 50257 gpt2.profile.txt
  ./nnscaler-rt run gpt2-bf16-step.nnsx --backend cuda --repeat 5 --inputs gpt2-bf16-step.in.safetensors \
    --inputs gpt2-step.params.safetensors -o /dev/null || status=1
  "$py" torch_ref.py step 12 12 768 1024 8 50257 bf16 || status=1
  rm -f gpt2-step.params.safetensors
  if [ -z "$quick" ]; then
    echo "== [${SECONDS} s] what a user runs instead (nn.Module, SDPA; eager fp32, TF32, bf16 autocast + fused AdamW)"
    "$py" torch_user.py || status=1
    "$py" torch_user.py --gpt2 || status=1
    echo "== [${SECONDS} s] GEMM 2048^3 fp32"
    "$py" compare.py inputs gemm.nnsx gemm.in.safetensors
    ./nnscaler-rt run gemm.nnsx --backend cuda --repeat 5 --inputs gemm.in.safetensors -o /dev/null || status=1
    "$py" torch_ref.py gemm 2048 || status=1
  fi
fi
# The step times above as one table, with the ratios.
sleep 0.2
echo "== [${SECONDS} s] summary: step times (ms), ours against PyTorch on this GPU"
"$py" compare.py summary "$log" || status=1
# Per-launch kernel times (ncu), into $OUT when set: the attention kernels alone (with
# their registers and occupancy), and the nanoGPT GPU config's fp32 step.
if within "ncu"; then
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  if [ -x "$ncu" ] && [ -n "${OUT:-}" ]; then
    echo "== [${SECONDS} s] ncu: attention kernels (nanoGPT shape), then every launch of the nanoGPT steps"
    timeout 120 "$ncu" --csv --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed \
      ./nnscaler-rt run attn-nanogpt.nnsx --backend cuda --inputs attn-nanogpt.in.safetensors -o /dev/null > "$OUT/attn-nanogpt.ncu.csv" 2>&1 || true
    grep -E 'attn|atten' "$OUT/attn-nanogpt.ncu.csv" | head -20 || true
    timeout 100 "$ncu" --csv --metrics gpu__time_duration.sum ./nnscaler-rt run nanogpt-gpu-step.nnsx --backend cuda \
      --inputs nanogpt-gpu-step.in.safetensors --inputs nanogpt-gpu-step.params.safetensors -o /dev/null > "$OUT/nanogpt-gpu-step.ncu.csv" 2>&1 || true
    "$py" compare.py families "$OUT/nanogpt-gpu-step.ncu.csv" || true
  else
    echo "== [${SECONDS} s] ncu: skipped (no ncu, or no \$OUT for its files)"
  fi
fi
if [ -n "$quick" ]; then exit $status; fi
if within "the PyTorch importer"; then
  echo "== [${SECONDS} s] the PyTorch importer on this machine's torch: F.scaled_dot_product_attention (its files to \$OUT; nnscaler run checks them where nnscaler is, docs/pytorch.md)"
  if "$py" importer.py torch_models.py:gpt_sdpa --input idx=2x8:i64 --input targets=2x8:i64 \
      --params sdpa.params.safetensors > sdpa.mlir; then
    echo "dnn.attention ops: $(grep -c '"dnn.attention"' sdpa.mlir)"
    "$py" import_ref.py torch_models.py:gpt_sdpa sdpa.params.safetensors sdpa.batch.safetensors \
      sdpa.want.safetensors idx=2x8:i64 targets=2x8:i64 || status=1
    if [ -n "${OUT:-}" ]; then cp sdpa.mlir sdpa.params.safetensors sdpa.batch.safetensors sdpa.want.safetensors "$OUT/" 2>/dev/null || true; fi
  else
    status=1
  fi
fi
echo "== [${SECONDS} s] what the runtime holds outside a program (the cost model's GPU_RESERVED and GPU_FRAGMENTATION)"
timeout 120 "$py" memory_reserve.py || status=1
echo "== [${SECONDS} s] calibration benchmarks (fit them with: nnscaler calibrate --device gpu --timings calib-timings.json)"
# 2026-12-04 the 'add' (stream) entry read 0.39 TB/s and 'gelu' 0.37 TB/s where the step's own
# adds ran at 3.4 TB/s by ncu: each timed run freed the last run's arena and the memory
# pool unmapped it at the step's synchronize. The pool now keeps freed memory and timed runs
# reuse their arenas (rt/src/cuda.rs keep_freed_memory); expect 'add' near 3 TB/s or more.
timeout 120 ./nnscaler-rt bench calib/calibrate.json --backend cuda -o calib-timings.json || status=1
if [ -n "${OUT:-}" ] && [ -f calib-timings.json ]; then cp calib-timings.json "$OUT/"; fi
cat calib-timings.json 2>/dev/null || true
echo "check.sh: done in ${SECONDS} s (exit $status)"
exit $status

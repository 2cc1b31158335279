#!/usr/bin/env bash
# Makes the folder bench/gpu/check.sh runs on a machine with an NVIDIA GPU (no Rust, no
# network there): nnscaler-rt built with the CUDA backend, compiled artifacts, their inputs
# and the CPU runtime's results to compare with, and the PyTorch reference scripts.
#   bench/gpu/prepare.sh OUT_DIR        (then carry OUT_DIR, well under 64 MiB, and run
#                                        OUT_DIR/check.sh there)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:?usage: bench/gpu/prepare.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$root"
cargo build --release -q --bin nnscaler --bin nnscaler-opt
cargo build --release -q -p nnscaler-rt --features cuda
bin=$root/target/release
cp "$bin/nnscaler-rt" bench/gpu/check.sh bench/gpu/train.sh bench/gpu/compare.py bench/gpu/torch_ref.py bench/gpu/torch_families.py test/oracle/models.py "$out/"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
py=${NNSCALER_PYTHON:-/usr/bin/python3}
sched() { "$py" -c "import sys; sys.path.insert(0, '$root/test/oracle'); import st, numpy as np; d = st.load('$1'); d['lr'] = np.array(1e-3, np.float32); d['step'] = np.array(3.0, np.float32); st.save('$1', d)"; }

# case NAME MODEL.mlir [DEVICES WHOLE.mlir]: the artifact, inputs (drawn for WHOLE, the
# unpartitioned model, when MODEL is one device's share), parameters and the CPU results.
case_() {
  local name=$1 model=$2 devices=${3:-1} whole=${4:-$2}
  "$bin/nnscaler" compile "$model" -o "$out/$name.nnsx" > /dev/null
  "$bin/nnscaler" data random "$whole" -o "$out/$name.in.safetensors" > /dev/null
  if grep -q '"step"' "$model"; then sched "$out/$name.in.safetensors"; fi
  "$bin/nnscaler" run "$model" --devices "$devices" --inputs "$out/$name.in.safetensors" \
    --init-seed 0 --save-params "$out/$name.params.safetensors" -o "$out/$name.want.safetensors" > /dev/null
  # A training step with an optimizer: its state warm, not zero (compare.py says why),
  # and the CPU runtime's results from that.
  if grep -q '"adam\.' "$model"; then
    "$py" "$root/bench/gpu/compare.py" warm "$out/$name.params.safetensors" > /dev/null
    "$bin/nnscaler" run "$model" --devices "$devices" --inputs "$out/$name.in.safetensors" \
      --params "$out/$name.params.safetensors" -o "$out/$name.want.safetensors" > /dev/null
  fi
  echo "prepared $name"
}

# nanoGPT's GPU example as a training bundle for train.sh (the corpus prepared from
# ../shared/data's tinyshakespeare; the config's log, curve and checkpoint paths are
# relative to where train.sh runs).
shakespeare=$root/../shared/data/tinyshakespeare/input.txt
"$bin/nnscaler" data prepare-char "$shakespeare" -o shakespeare_char > /dev/null
"$bin/nnscaler" train --config "$root/examples/nanogpt/gpu.toml" --set data.dir='"shakespeare_char"' \
  --bundle "$out/nanogpt-gpu.bundle" > /dev/null
echo "prepared nanogpt-gpu.bundle (train.sh)"

"$bin/nnscaler" import gpt --preset gpt-tiny --batch 4 --heads 4 -o gpt.mlir
"$bin/nnscaler-opt" --autodiff --optimizer="clip=1.0 weight_decay=0.1" gpt.mlir -o gpt-step.mlir
case_ gpt-tiny-step gpt-step.mlir
"$bin/nnscaler-opt" --autodiff --plan="dp-megatron dp=2 tp=2" --propagate-layouts --split-tensor \
  --lower-relayouts --localize gpt.mlir -o gpt-dptp.mlir
case_ gpt-tiny-dptp gpt-dptp.mlir 4 gpt.mlir
# A pipeline: pp2 x dp2 x tp2, 4 micro-batches, 1F1B, on 8 virtual devices.
"$bin/nnscaler" import gpt --preset gpt-tiny --batch 8 --heads 4 -o gpt8.mlir
"$bin/nnscaler-opt" --place="stages=2" --autodiff --plan="dp-megatron dp=2 tp=2 pp=2 microbatches=4" \
  --split-tensor --schedule-1f1b --lower-relayouts --localize gpt8.mlir -o gpt-pp.mlir
case_ gpt-tiny-pp gpt-pp.mlir 8 gpt8.mlir
# Mixed precision (--autocast=bf16: bf16 products, most bf16 values in 2-byte buffers).
"$bin/nnscaler-opt" --autocast=bf16 --autodiff --optimizer="clip=1.0 weight_decay=0.1" gpt.mlir -o gpt-bf16-step.mlir
case_ gpt-tiny-bf16-step gpt-bf16-step.mlir
# Every activation in bf16 (--autocast="bf16 activations=bf16").
"$bin/nnscaler-opt" --autocast="bf16 activations=bf16" --autodiff --optimizer="clip=1.0 weight_decay=0.1" gpt.mlir -o gpt-act-step.mlir 2> /dev/null
case_ gpt-tiny-bf16act-step gpt-act-step.mlir
"$bin/nnscaler" import --preset nanogpt-cpu -o nano.mlir
"$bin/nnscaler-opt" --autodiff --optimizer="clip=1.0 weight_decay=0.1" nano.mlir -o nano-step.mlir
case_ nanogpt-cpu-step nano-step.mlir

# Timing only: the seed's GPU config (6 layers, 6 heads, width 384, block 256, batch 64,
# no dropout, like the PyTorch reference it is timed against); parameters are drawn on the
# GPU machine.
"$bin/nnscaler" import gpt --preset nanogpt-cpu --layers 6 --heads 6 --width 384 --block 256 --batch 64 --vocab 65 -o big.mlir
"$bin/nnscaler-opt" --autodiff --optimizer="clip=1.0 weight_decay=0.1" big.mlir -o big-step.mlir
"$bin/nnscaler" compile big-step.mlir -o "$out/nanogpt-gpu-step.nnsx" > /dev/null
"$bin/nnscaler" data random big-step.mlir -o "$out/nanogpt-gpu-step.in.safetensors" > /dev/null
sched "$out/nanogpt-gpu-step.in.safetensors"
echo "prepared nanogpt-gpu-step (timing)"
"$bin/nnscaler-opt" --autocast=bf16 --autodiff --optimizer="clip=1.0 weight_decay=0.1" big.mlir -o big-bf16-step.mlir
"$bin/nnscaler" compile big-bf16-step.mlir -o "$out/nanogpt-gpu-bf16-step.nnsx" > /dev/null
cp "$out/nanogpt-gpu-step.in.safetensors" "$out/nanogpt-gpu-bf16-step.in.safetensors"
echo "prepared nanogpt-gpu-bf16-step (timing)"
# Every activation in bf16 (--autocast="bf16 activations=bf16", Megatron-LM's --bf16): the
# elementwise ops and norms read and write 2-byte values too.
"$bin/nnscaler-opt" --autocast="bf16 activations=bf16" --autodiff --optimizer="clip=1.0 weight_decay=0.1" big.mlir -o big-act-step.mlir 2> /dev/null
"$bin/nnscaler" compile big-act-step.mlir -o "$out/nanogpt-gpu-act-step.nnsx" > /dev/null
cp "$out/nanogpt-gpu-step.in.safetensors" "$out/nanogpt-gpu-act-step.in.safetensors"
echo "prepared nanogpt-gpu-act-step (timing)"
# The row teams' size swept (NNSCALER_ROW_ELEMS: elements a lane aims for; 1 is the
# default), for check.sh to time on the same inputs and choose the default from.
for e in 2 4 8 16; do
  NNSCALER_ROW_ELEMS=$e "$bin/nnscaler" compile big-step.mlir -o "$out/nanogpt-gpu-step-rows$e.nnsx" > /dev/null
done
echo "prepared nanogpt-gpu-step-rows{2,4,8,16} (the row-team sweep)"
# f32 attention on tensor cores as three TF32 products (NNSCALER_ATTN_F32=tf32x3;
# the register tiles are the default), for check.sh to time against the step above.
NNSCALER_ATTN_F32=tf32x3 "$bin/nnscaler" compile big-step.mlir -o "$out/nanogpt-gpu-step-tf32x3.nnsx" > /dev/null
echo "prepared nanogpt-gpu-step-tf32x3"

# A 2048^3 matrix product alone, for the GEMM rate.
cat > gemm.mlir <<'MLIR'
func.func @train(%a: tensor<2048x2048xf32> {nns.name = "a"}, %b: tensor<2048x2048xf32> {nns.name = "b"}) -> (tensor<2048x2048xf32> {nns.name = "c"}) {
  %c = "dnn.matmul"(%a, %b) : (tensor<2048x2048xf32>, tensor<2048x2048xf32>) -> tensor<2048x2048xf32>
  return %c : tensor<2048x2048xf32>
}
MLIR
"$bin/nnscaler" compile gemm.mlir -o "$out/gemm.nnsx" > /dev/null
# Attention alone (causal, fp32), for its time against PyTorch's scaled_dot_product_attention
# at the nanoGPT GPU config's and GPT-2's shapes: the forward, and forward + backward
# (inputs drawn on the GPU machine: compare.py inputs); and a check of the tiled kernels
# against the CPU runtime at head width 64 over several tiles (causal, and grouped heads
# with more keys than queries).
attn_mlir() { # NAME B H T D GRAD
  local ty="tensor<$2x$3x$4x$5xf32>"
  if [ "$6" = 1 ]; then
    cat > "$1.mlir" <<MLIR
func.func @train(%q: $ty {nns.name = "q"}, %k: $ty {nns.name = "k"}, %v: $ty {nns.name = "v"}, %dy: $ty {nns.name = "dy"}) -> ($ty {nns.name = "out"}, $ty {nns.name = "dq"}, $ty {nns.name = "dk"}, $ty {nns.name = "dv"}) {
  %o = "dnn.attention"(%q, %k, %v) {causal = true} : ($ty, $ty, $ty) -> $ty
  %dq, %dk, %dv = "dnn.attention_grad"(%dy, %q, %k, %v) {causal = true} : ($ty, $ty, $ty, $ty) -> ($ty, $ty, $ty)
  return %o, %dq, %dk, %dv : $ty, $ty, $ty, $ty
}
MLIR
  else
    cat > "$1.mlir" <<MLIR
func.func @train(%q: $ty {nns.name = "q"}, %k: $ty {nns.name = "k"}, %v: $ty {nns.name = "v"}) -> ($ty {nns.name = "out"}) {
  %o = "dnn.attention"(%q, %k, %v) {causal = true} : ($ty, $ty, $ty) -> $ty
  return %o : $ty
}
MLIR
  fi
  "$bin/nnscaler" compile "$1.mlir" -o "$out/$1.nnsx" > /dev/null
}
attn_mlir attn-nanogpt-fwd 64 6 256 64 0
attn_mlir attn-nanogpt 64 6 256 64 1
attn_mlir attn-gpt2-fwd 8 12 1024 64 0
attn_mlir attn-gpt2 8 12 1024 64 1
# The same with f32 attention on tensor cores (three TF32 products, forward and backward).
for c in attn-nanogpt-fwd attn-nanogpt attn-gpt2-fwd attn-gpt2; do
  NNSCALER_ATTN_F32=tf32x3 "$bin/nnscaler" compile "$c.mlir" -o "$out/${c/attn-/attn-tf32x3-}.nnsx" > /dev/null
done
# bf16 attention on tensor cores at the same shapes: a training step of the attention alone
# (q, k, v parameters, loss mean(out * w); autocast, then autodiff: the forward keeping its
# statistics, the backward's two kernels), with the forward's key tiles in two buffers (the
# default) and, at the nanoGPT shape, in one (NNSCALER_ATTN_BUFFERS=1; GPT-2's would take
# the folder over 64 MiB), timed by family (--profile).
attn_bf16_mlir() { # NAME B H T D [one-buffer-too]
  local ty="tensor<$2x$3x$4x$5xf32>"
  cat > "$1.mlir" <<MLIR
func.func @train(%q: $ty {nns.name = "q", nns.param}, %k: $ty {nns.name = "k", nns.param}, %v: $ty {nns.name = "v", nns.param}, %w: $ty {nns.name = "w"}) -> (tensor<f32> {nns.name = "loss"}) {
  %o = "dnn.attention"(%q, %k, %v) {causal = true} : ($ty, $ty, $ty) -> $ty
  %p = "dnn.mul"(%o, %w) : ($ty, $ty) -> $ty
  %l = "dnn.mean"(%p) {dims = array<i64: 0, 1, 2, 3>} : ($ty) -> tensor<f32>
  return %l : tensor<f32>
}
MLIR
  "$bin/nnscaler-opt" --autocast=bf16 --autodiff "$1.mlir" -o "$1-step.mlir" 2> /dev/null
  "$bin/nnscaler" compile "$1-step.mlir" -o "$out/$1.nnsx" > /dev/null
  if [ -n "${6:-}" ]; then
    NNSCALER_ATTN_BUFFERS=1 "$bin/nnscaler" compile "$1-step.mlir" -o "$out/$1-b1.nnsx" > /dev/null
  fi
}
attn_bf16_mlir attn-bf16-nanogpt 64 6 256 64 b1
attn_bf16_mlir attn-bf16-gpt2 8 12 1024 64
echo "prepared attention timing cases"
cat > attn-check.mlir <<'MLIR'
func.func @train(%q: tensor<2x2x300x64xf32> {nns.name = "q"}, %dy: tensor<2x2x300x64xf32> {nns.name = "dy"},
                 %gq: tensor<1x4x130x64xf32> {nns.name = "gq"}, %gk: tensor<1x2x200x64xf32> {nns.name = "gk"},
                 %gv: tensor<1x2x200x64xf32> {nns.name = "gv"}, %gdy: tensor<1x4x130x64xf32> {nns.name = "gdy"})
    -> (tensor<2x2x300x64xf32> {nns.name = "out"}, tensor<2x2x300x64xf32> {nns.name = "dq"}, tensor<2x2x300x64xf32> {nns.name = "dk"}, tensor<2x2x300x64xf32> {nns.name = "dv"},
        tensor<1x4x130x64xf32> {nns.name = "gout"}, tensor<1x4x130x64xf32> {nns.name = "gdq"}, tensor<1x2x200x64xf32> {nns.name = "gdk"}, tensor<1x2x200x64xf32> {nns.name = "gdv"}) {
  %o = "dnn.attention"(%q, %q, %dy) {causal = true} : (tensor<2x2x300x64xf32>, tensor<2x2x300x64xf32>, tensor<2x2x300x64xf32>) -> tensor<2x2x300x64xf32>
  %dq, %dk, %dv = "dnn.attention_grad"(%dy, %q, %q, %dy) {causal = true} : (tensor<2x2x300x64xf32>, tensor<2x2x300x64xf32>, tensor<2x2x300x64xf32>, tensor<2x2x300x64xf32>) -> (tensor<2x2x300x64xf32>, tensor<2x2x300x64xf32>, tensor<2x2x300x64xf32>)
  %go = "dnn.attention"(%gq, %gk, %gv) : (tensor<1x4x130x64xf32>, tensor<1x2x200x64xf32>, tensor<1x2x200x64xf32>) -> tensor<1x4x130x64xf32>
  %gdq, %gdk, %gdv = "dnn.attention_grad"(%gdy, %gq, %gk, %gv) : (tensor<1x4x130x64xf32>, tensor<1x4x130x64xf32>, tensor<1x2x200x64xf32>, tensor<1x2x200x64xf32>) -> (tensor<1x4x130x64xf32>, tensor<1x2x200x64xf32>, tensor<1x2x200x64xf32>)
  return %o, %dq, %dk, %dv, %go, %gdq, %gdk, %gdv : tensor<2x2x300x64xf32>, tensor<2x2x300x64xf32>, tensor<2x2x300x64xf32>, tensor<2x2x300x64xf32>, tensor<1x4x130x64xf32>, tensor<1x4x130x64xf32>, tensor<1x2x200x64xf32>, tensor<1x2x200x64xf32>
}
MLIR
case_ attn-check attn-check.mlir
NNSCALER_ATTN_F32=tf32x3 "$bin/nnscaler" compile attn-check.mlir -o "$out/attn-check-tf32x3.nnsx" > /dev/null
echo "prepared attn-check-tf32x3 (attn-check's inputs and results)"
# bf16 attention on tensor cores in a training step (the forward, and the backward's dq and
# dk/dv kernels reading its kept statistics), for check.sh's kernel-by-kernel comparison
# with the host kernels.
cat > attn-bf16.mlir <<'MLIR'
func.func @train(%q: tensor<2x2x300x64xf32> {nns.name = "q", nns.param}, %k: tensor<2x2x300x64xf32> {nns.name = "k", nns.param},
                 %v: tensor<2x2x300x64xf32> {nns.name = "v", nns.param}, %y: tensor<1200xi64> {nns.name = "labels"}) -> (tensor<f32> {nns.name = "loss"}) {
  %o = "dnn.attention"(%q, %k, %v) {causal = true} : (tensor<2x2x300x64xf32>, tensor<2x2x300x64xf32>, tensor<2x2x300x64xf32>) -> tensor<2x2x300x64xf32>
  %r = "dnn.reshape"(%o) {shape = [1200, 64]} : (tensor<2x2x300x64xf32>) -> tensor<1200x64xf32>
  %c = "dnn.cross_entropy"(%r, %y) : (tensor<1200x64xf32>, tensor<1200xi64>) -> tensor<f32>
  return %c : tensor<f32>
}
MLIR
"$bin/nnscaler-opt" --autocast=bf16 --autodiff attn-bf16.mlir -o attn-bf16-step.mlir 2> /dev/null
case_ attn-bf16 attn-bf16-step.mlir
# GPT-2 124M (12 layers, 12 heads, width 768, block 1024, batch 8, vocab 50257): timing
# only, fp32 and mixed precision; parameters drawn on the GPU machine (compare.py params).
"$bin/nnscaler" import gpt --preset nanogpt-cpu --layers 12 --heads 12 --width 768 --block 1024 --batch 8 --vocab 50257 -o gpt2.mlir
"$bin/nnscaler-opt" --autodiff --optimizer="clip=1.0 weight_decay=0.1" gpt2.mlir -o gpt2-step.mlir
"$bin/nnscaler" compile gpt2-step.mlir -o "$out/gpt2-step.nnsx" > /dev/null
"$bin/nnscaler-opt" --autocast=bf16 --autodiff --optimizer="clip=1.0 weight_decay=0.1" gpt2.mlir -o gpt2-bf16-step.mlir
"$bin/nnscaler" compile gpt2-bf16-step.mlir -o "$out/gpt2-bf16-step.nnsx" > /dev/null
# The batch and the schedule's scalars only (the parameters are drawn there).
"$py" -c "
import sys; sys.path.insert(0, '$root/test/oracle'); import st, numpy as np
r = np.random.default_rng(0)
st.save('$out/gpt2-step.in.safetensors', {'tokens': r.integers(0, 50257, (8, 1024)), 'targets': r.integers(0, 50257, (8, 1024)),
         'lr': np.array(1e-3, np.float32), 'step': np.array(3.0, np.float32)})"
cp "$out/gpt2-step.in.safetensors" "$out/gpt2-bf16-step.in.safetensors"
echo "prepared gpt2-step, gpt2-bf16-step (timing)"
cp "$root/bench/gpu/torch_user.py" "$root/bench/gpu/memory_reserve.py" "$out/"
# The PyTorch importer and a model for the GPU machine's torch 2.x (check.sh).
cp "$root/frontends/torch/nnscaler_torch/importer.py" "$root/test/tools/Inputs/torch_models.py" "$out/"
cp "$root/test/tools/Inputs/torch_ref.py" "$out/import_ref.py"

# The cost model's GPU entries: benchmarks nnscaler-rt bench times there (fitted here
# afterwards with nnscaler calibrate --device gpu --timings).
rm -rf "$out/calib"
"$bin/nnscaler" calibrate --device gpu --prepare "$out/calib" > /dev/null
du -sh "$out"
# A device run carries at most 64 MiB: say so here, not there.
bytes=$(du -sb "$out" | cut -f1)
if [ "$bytes" -gt $((64 * 1024 * 1024)) ]; then
  echo "prepare.sh: $out is $bytes bytes, over the 64 MiB a device run carries" >&2
  exit 1
fi

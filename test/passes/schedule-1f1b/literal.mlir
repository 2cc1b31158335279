// The user's own example: a module that carries a mesh with a pipeline axis (pp), a
// micro-batch axis and its layouts, and stages on its ops; `--split-tensor
// --schedule-1f1b` makes the verified pipelined program (split-tensor runs
// propagate-layouts first), and `--lower-relayouts --localize` makes it runnable.
// RUN: nnscaler-opt --autodiff %s -o %t.train.mlir
// RUN: nnscaler-opt --split-tensor --schedule-1f1b %t.train.mlir 2>&1 | FileCheck %s
// RUN: nnscaler-opt --split-tensor --schedule-1f1b --lower-relayouts --localize %t.train.mlir -o %t.run.mlir
// RUN: %python -c "import sys; sys.path.insert(0, '%oracle'); import st, numpy as np; r = np.random.default_rng(1); st.save('%t.in.safetensors', {'x': r.standard_normal((16, 8)).astype(np.float32), 'y': r.integers(0, 4, (16,))})"
// RUN: nnscaler run %t.train.mlir --inputs %t.in.safetensors --init-seed 5 -o %t.one.safetensors
// RUN: nnscaler run %t.run.mlir --devices 4 --inputs %t.in.safetensors --init-seed 5 -o %t.pp.safetensors
// RUN: %python %S/../../tools/Inputs/allclose.py %t.pp.safetensors %t.one.safetensors 1e-5 %oracle | FileCheck %s --check-prefix=SAME
// SAME: allclose: 3 tensors

// CHECK: remark: split-tensor: @train has no layouts; running --propagate-layouts first
// Fragments: each stage's forward and backward, over one micro-batch (batch dims split
// over mb, so --localize gives them micro-batch shapes).
// CHECK-LABEL: func.func private @train.s0.F(
// CHECK-SAME: #nns.layout<@world, dp = D(0), mb = D(0)>
// CHECK-LABEL: func.func private @train.s0.B(
// CHECK-LABEL: func.func private @train.s1.F(
// CHECK: "dnn.cross_entropy"
// CHECK-SAME: #nns.layout<@world, dp = V(sum), mb = V(sum)>
// CHECK-LABEL: func.func private @train.s1.B(
// 1F1B, p = 2, m = 4: rank 0 warms up with one extra forward, then alternates.
// CHECK-LABEL: func.func @train.pp0(
// CHECK-SAME: {{.*}}nns.arg = 0 : i64, nns.layout = #nns.layout<@world, dp = D(0)>, nns.name = "x"
// CHECK-SAME: nns.schedule = "1f1b: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3"
// CHECK: "nns.microbatch"(%arg0) {axes = ["mb"], dim = 0 : i64, index = 0 : i64
// CHECK-NEXT: call @train.s0.F({{.*}}) {nns.fragment = "0F0"
// CHECK-NEXT: "nns.send"({{.*}}) {axis = "pp", peer = 1 : i64, tag = "[[A0:v[0-9]+]].mb0"}
// CHECK: nns.fragment = "0F1"
// CHECK: "nns.recv"() {axis = "pp", {{.*}}peer = 1 : i64, tag = "[[G:v[0-9]+]].mb0"}
// CHECK-NEXT: call @train.s0.B({{.*}}) {nns.fragment = "0B0"
// CHECK: nns.fragment = "0F2"
// CHECK: nns.fragment = "0B1"
// CHECK-NEXT: "dnn.add"({{.*}}) {nns.accumulate
// CHECK: nns.fragment = "0F3"
// CHECK: nns.fragment = "0B2"
// CHECK: nns.fragment = "0B3"
// After the last micro-batch: the data-parallel reduction of the accumulated gradient.
// CHECK: "nns.relayout"
// CHECK-NEXT: return
// CHECK-LABEL: func.func @train.pp1(
// CHECK-SAME: nns.schedule = "1f1b: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"
// CHECK: "nns.recv"() {axis = "pp", {{.*}}peer = 0 : i64, tag = "[[A0]].mb0"}
// CHECK: nns.fragment = "1F0"
// CHECK: nns.fragment = "1B0"
// CHECK-NEXT: "nns.send"({{.*}}) {axis = "pp", peer = 0 : i64, tag = "[[G]].mb0"}
// CHECK: nns.fragment = "1F1"
// CHECK: nns.fragment = "1B1"
// CHECK: nns.fragment = "1F2"
// CHECK: nns.fragment = "1B2"
// CHECK: nns.fragment = "1F3"
// CHECK: nns.fragment = "1B3"
// CHECK: return

"nns.mesh"() {sym_name = "world", axes = #nns.axes<pp = 2, dp = 2, mb = 4 (microbatches)>} : () -> ()
func.func @train(%x: tensor<16x8xf32> {nns.name = "x", nns.layout = #nns.layout<@world, dp = D(0), mb = D(0)>},
                 %y: tensor<16xi64> {nns.name = "y", nns.layout = #nns.layout<@world, dp = D(0), mb = D(0)>},
                 %w1: tensor<32x8xf32> {nns.name = "w1", nns.param},
                 %w2: tensor<4x32xf32> {nns.name = "w2", nns.param}) -> (tensor<f32> {nns.name = "loss"}) {
  %h = "dnn.linear"(%x, %w1) {nns.stage = 0 : i64} : (tensor<16x8xf32>, tensor<32x8xf32>) -> tensor<16x32xf32>
  %a = "dnn.relu"(%h) {nns.stage = 0 : i64} : (tensor<16x32xf32>) -> tensor<16x32xf32>
  %o = "dnn.linear"(%a, %w2) {nns.stage = 1 : i64} : (tensor<16x32xf32>, tensor<4x32xf32>) -> tensor<16x4xf32>
  %l = "dnn.cross_entropy"(%o, %y) {nns.stage = 1 : i64} : (tensor<16x4xf32>, tensor<16xi64>) -> tensor<f32>
  return %l : tensor<f32>
}

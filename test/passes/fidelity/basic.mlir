// Passes change what they must and nothing else: module attributes, declarations, functions
// that are not ours (index arguments, regions, upstream ops), typed attributes of every
// kind, escaped strings and fused / name / call-site locations survive the whole pipeline.
// RUN: nnscaler-opt --autodiff --plan="dp-megatron dp=2 tp=2" --propagate-layouts --split-tensor --lower-relayouts --localize --mlir-print-debuginfo --mlir-print-local-scope %s | FileCheck %s
// RUN: nnscaler-opt --autodiff --plan="dp-megatron dp=2 tp=2" --propagate-layouts --split-tensor --lower-relayouts --localize %s | mlir-opt --allow-unregistered-dialect | FileCheck %s --check-prefix=UPSTREAM

// CHECK: module attributes {my.flag, my.level = 3 : i32}
module attributes {my.level = 3 : i32, my.flag} {
  // CHECK: func.func private @external(tensor<4xf32>) -> tensor<4xf32>
  func.func private @external(tensor<4xf32>) -> tensor<4xf32>

  // A helper in upstream dialects, with an index argument and a region: not ours.
  // CHECK-LABEL: func.func private @helper(%arg0: index{{.*}}, %arg1: index{{.*}}) -> index
  // CHECK-NEXT: %{{.*}} = scf.for %{{.*}} = %arg0 to %arg1 step %arg0 iter_args(%{{.*}} = %arg0) -> (index) {
  // CHECK: loc("helper.mlir":7:7)
  func.func private @helper(%lo: index, %hi: index) -> index {
    %r = scf.for %i = %lo to %hi step %lo iter_args(%acc = %lo) -> (index) {
      %s = arith.addi %acc, %i : index loc("helper.mlir":7:7)
      scf.yield %s : index
    }
    return %r : index
  }

  // Block arguments keep their locations.
  // CHECK: func.func @train(%arg0: tensor<2x8xf32> {{.*}} loc("{{.*}}basic.mlir":[[@LINE+3]]:20)
  // CHECK-SAME: attributes {my.note = "kept", nns.localized = #nns.axes<dp = 2, tp = 2>}
  func.func @train(%x: tensor<4x8xf32> {nns.name = "x"}, %y: tensor<4xi64> {nns.name = "labels"},
                   %w: tensor<16x8xf32> {nns.name = "fc.weight", nns.param},
                   %v: tensor<6x16xf32> {nns.name = "head.weight", nns.param})
      -> (tensor<f32> {nns.name = "loss"}) attributes {my.note = "kept"} {
    // Typed attributes of every builtin kind stay exactly as written.
    // CHECK: "dnn.linear"(%{{.*}}) {my.arr = [1, 2], my.dense = dense<[1.000000e+00, 2.000000e+00]> : tensor<2xf32>, my.f32 = 2.500000e+00 : f32, my.i32 = 7 : i32, my.idx = 3 : index, my.str = "a\0Ab", my.unit
    // CHECK-SAME: loc(fused["a.mlir":1:2, "b.mlir":3:4])
    %h = "dnn.linear"(%x, %w) {my.i32 = 7 : i32, my.idx = 3 : index, my.f32 = 2.5 : f32, my.arr = [1, 2], my.str = "a\nb", my.unit, my.dense = dense<[1.0, 2.0]> : tensor<2xf32>} : (tensor<4x8xf32>, tensor<16x8xf32>) -> tensor<4x16xf32> loc(fused["a.mlir":1:2, "b.mlir":3:4])
    // CHECK: "dnn.gelu"{{.*}} loc("gelu"("f.mlir":5:6))
    %g = "dnn.gelu"(%h) : (tensor<4x16xf32>) -> tensor<4x16xf32> loc("gelu"("f.mlir":5:6))
    // CHECK: "dnn.linear"{{.*}} loc(callsite("head"("c.mlir":1:1) at "d.mlir":2:2))
    %l = "dnn.linear"(%g, %v) : (tensor<4x16xf32>, tensor<6x16xf32>) -> tensor<4x6xf32> loc(callsite("head"("c.mlir":1:1) at "d.mlir":2:2))
    %c = "dnn.cross_entropy"(%l, %y) : (tensor<4x6xf32>, tensor<4xi64>) -> tensor<f32>
    // Backward ops carry the exact location of their forward op.
    // CHECK: "dnn.gelu_grad"{{.*}} loc("gelu"("f.mlir":5:6))
    // The return keeps its location.
    // CHECK: return {{.*}} loc("{{.*}}basic.mlir":[[@LINE+1]]:5)
    return %c : tensor<f32>
  }
}

// UPSTREAM: module attributes {my.flag, my.level = 3 : i32}
// UPSTREAM: func.func private @external
// UPSTREAM: my.i32 = 7 : i32

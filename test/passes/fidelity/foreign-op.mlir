// An op the partitioner has no spec for (here arith.addf) runs replicated inside a
// partitioned function: its operands are gathered to R, its result is R, and a remark says
// so, as MLIR's own spmdization treats ops without a sharding interface.
// RUN: nnscaler-opt --plan="dp dp=2" --propagate-layouts --split-tensor --lower-relayouts --localize %s 2>%t.err | FileCheck %s
// RUN: FileCheck %s --check-prefix=REMARK < %t.err
// RUN: nnscaler-opt --plan="dp dp=2" --propagate-layouts --verify-diagnostics %s
// RUN: nnscaler-opt '--pass-pipeline=builtin.module(plan{dp dp=2},func.func(propagate-layouts,split-tensor,lower-relayouts),localize)' %s 2>/dev/null | FileCheck %s

// REMARK: foreign-op.mlir:[[@LINE+11]]:8: remark: propagate-layouts: 'arith.addf' has no dnn spec; it runs replicated (its operands are gathered, its results replicated on every device)

// CHECK-LABEL: func.func @train
// CHECK-SAME: tensor<4x4xf32> {nns.layout = #nns.layout<@world, dp = D(0)>
// CHECK: %[[Y:.*]] = "dnn.matmul"({{.*}} : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
// CHECK-NEXT: %[[G:.*]] = "nns.all_gather"(%[[Y]]) {axes = ["dp"], dim = 0 : i64{{.*}}} : (tensor<4x4xf32>) -> tensor<8x4xf32>
// CHECK-NEXT: %[[Z:.*]] = arith.addf %[[G]], %[[G]] {nns.layouts = [#nns.layout<@world>]} : tensor<8x4xf32>
// CHECK-NEXT: "dnn.relu"(%[[Z]]) {nns.layouts = [#nns.layout<@world>]} : (tensor<8x4xf32>) -> tensor<8x4xf32>
func.func @train(%x: tensor<8x4xf32> {nns.name = "x"}, %w: tensor<4x4xf32> {nns.name = "w", nns.param}) -> (tensor<f32> {nns.name = "loss"}) {
  %y = "dnn.matmul"(%x, %w) : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
  // expected-remark@below {{'arith.addf' has no dnn spec; it runs replicated}}
  %z = arith.addf %y, %y : tensor<8x4xf32>
  %r = "dnn.relu"(%z) : (tensor<8x4xf32>) -> tensor<8x4xf32>
  %l = "dnn.mean"(%r) {dims = array<i64: 0, 1>} : (tensor<8x4xf32>) -> tensor<f32>
  return %l : tensor<f32>
}

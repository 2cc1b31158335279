// Calls of a user op are partitioned by its annotation like dnn ops: the split drives the
// collectives, --localize calls a specialization of the callee for the call's layouts, and
// --autodiff calls a derived VJP function with the annotation derived from the op's.
// RUN: nnscaler-opt --autodiff %s | FileCheck %s --check-prefix=AD
// RUN: nnscaler-opt --autodiff --plan=dp --propagate-layouts --split-tensor --lower-relayouts --localize %s | FileCheck %s

// AD: func.func private @gemm.vjp(%arg0: tensor<8x16xf32>, %arg1: tensor<16x4xf32>, %arg2: tensor<8x4xf32>) -> (tensor<8x16xf32>, tensor<16x4xf32>) attributes {nns.annotation = "m+ k, k n+, m+ n+ -> m k, k n"}
// AD: call @gemm.vjp(%arg0, %arg1, %{{.*}}) : (tensor<8x16xf32>, tensor<16x4xf32>, tensor<8x4xf32>) -> (tensor<8x16xf32>, tensor<16x4xf32>)

// The forward call: m split over dp, k over tp by the directive; the result is a partial
// sum over tp, which flows through the mean and is reduced with the loss.
// CHECK: func.func private @gemm.local0(%arg0: tensor<4x8xf32> {nns.layout = #nns.layout<@world, dp = D(0), tp = D(1)>}, %arg1: tensor<8x4xf32> {nns.layout = #nns.layout<@world, tp = D(0)>}) -> (tensor<4x4xf32> {nns.layout = #nns.layout<@world, dp = D(0), tp = V(sum)>}) attributes {nns.localized = #nns.axes<dp = 2, tp = 2>}
// CHECK: func.func private @gemm.vjp.local0(
// CHECK-LABEL: func.func @train
// CHECK: call @gemm.local0(%{{.*}}) {{.*}}nns.split = #nns.split<k = tp, m = dp>} : (tensor<4x8xf32>, tensor<8x4xf32>) -> tensor<4x4xf32>
// CHECK: call @gemm.vjp.local0(
// CHECK: "nns.all_reduce"(%{{.*}}) {axes = ["dp", "tp"]

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 2>} : () -> ()
func.func private @gemm(%a: tensor<8x16xf32>, %b: tensor<16x4xf32>) -> tensor<8x4xf32> attributes {nns.annotation = "m k+, k+ n -> m n"} {
  %0 = "dnn.matmul"(%a, %b) : (tensor<8x16xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>
  return %0 : tensor<8x4xf32>
}
func.func @train(%x: tensor<8x16xf32> {nns.name = "x"}, %w: tensor<16x4xf32> {nns.name = "w", nns.param}) -> (tensor<f32> {nns.name = "loss"}) {
  %y = func.call @gemm(%x, %w) {nns.split = #nns.split<k = tp>} : (tensor<8x16xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>
  %l = "dnn.mean"(%y) {dims = array<i64: 0, 1>} : (tensor<8x4xf32>) -> tensor<f32>
  return %l : tensor<f32>
}

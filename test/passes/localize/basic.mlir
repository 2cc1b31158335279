// RUN: nnscaler-opt --autodiff --plan="dp dp=2" --propagate-layouts --split-tensor --lower-relayouts --localize %s | FileCheck %s
// RUN: %not nnscaler-opt --localize %S/Inputs/unlowered.mlir 2>&1 | FileCheck %s --check-prefix=UNLOWERED
// UNLOWERED: unlowered.mlir:3:8: error: localize: relayouts remain; run --lower-relayouts first

// Data parallel over 2 devices: every batch-sized value is halved, the mean of the loss
// divides by the global token count, shape attributes follow the local shapes.
// CHECK-LABEL: func.func @train
// CHECK-SAME: %arg0: tensor<2x4xf32> {nns.layout = #nns.layout<@world, dp = D(0)>, nns.name = "x"}
// CHECK-SAME: attributes {nns.localized = #nns.axes<dp = 2>}
// CHECK: "dnn.linear"{{.*}} -> tensor<2x3xf32>
// CHECK: "dnn.reshape"{{.*}}shape = array<i64: 6>{{.*}} -> tensor<6xf32>
// CHECK: "dnn.mean"{{.*}}count = 12 : i64{{.*}} -> tensor<f32>
// CHECK: "nns.all_reduce"{{.*}}axes = ["dp"]
"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2>} : () -> ()
func.func @train(%x: tensor<4x4xf32> {nns.name = "x"}, %w: tensor<3x4xf32> {nns.name = "w", nns.param}) -> (tensor<f32> {nns.name = "loss"}) {
  %h = "dnn.linear"(%x, %w) : (tensor<4x4xf32>, tensor<3x4xf32>) -> tensor<4x3xf32>
  %f = "dnn.reshape"(%h) {shape = array<i64: 12>} : (tensor<4x3xf32>) -> tensor<12xf32>
  %l = "dnn.mean"(%f) {dims = array<i64: 0>} : (tensor<12xf32>) -> tensor<f32>
  return %l : tensor<f32>
}

// RUN: nnscaler-opt --autodiff %s | FileCheck %s
// RUN: nnscaler-opt --autodiff %s | nnscaler-opt --print-stats -o /dev/null 2>&1 | FileCheck %s --check-prefix=STATS

// A parameter used twice (w feeds both linears): its gradient is the sum of both uses.
// CHECK-LABEL: func.func @train
// CHECK-SAME: -> (tensor<f32> {nns.name = "loss"}, tensor<4x4xf32> {nns.name = "grad.w"}, tensor<4xf32> {nns.name = "grad.b"})
// CHECK: %[[H:.*]] = "dnn.linear"(%arg0, %arg2, %arg3)
// CHECK: %[[R:.*]] = "dnn.relu"(%[[H]])
// CHECK: %[[O:.*]] = "dnn.linear"(%[[R]], %arg2)
// CHECK: %[[L:.*]] = "dnn.cross_entropy"(%[[O]], %arg1)
// CHECK: %[[ONE:.*]] = "dnn.fill"() {shape = array<i64>, value = 1.000000e+00 : f64}
// CHECK: %[[DO:.*]] = "dnn.cross_entropy_grad"(%[[ONE]], %[[O]], %arg1)
// CHECK: %[[DR:.*]] = "dnn.matmul"(%[[DO]], %arg2)
// CHECK: %[[DW2:.*]] = "dnn.linear_weight_grad"(%[[DO]], %[[R]])
// CHECK: %[[DH:.*]] = "dnn.relu_grad"(%[[DR]], %[[H]])
// CHECK: %[[DW1:.*]] = "dnn.linear_weight_grad"(%[[DH]], %arg0)
// CHECK: %[[DB:.*]] = "dnn.sum"(%[[DH]]) {dims = array<i64: 0>}
// CHECK: %[[DW:.*]] = "dnn.add"(%[[DW2]], %[[DW1]])
// CHECK: return %[[L]], %[[DW]], %[[DB]]
// STATS: backward

func.func @train(%x: tensor<8x4xf32> {nns.name = "x"}, %y: tensor<8xi64> {nns.name = "labels"},
                 %w: tensor<4x4xf32> {nns.name = "w", nns.param}, %b: tensor<4xf32> {nns.name = "b", nns.param})
    -> (tensor<f32> {nns.name = "loss"}) {
  %h = "dnn.linear"(%x, %w, %b) : (tensor<8x4xf32>, tensor<4x4xf32>, tensor<4xf32>) -> tensor<8x4xf32>
  %r = "dnn.relu"(%h) : (tensor<8x4xf32>) -> tensor<8x4xf32>
  %o = "dnn.linear"(%r, %w) : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
  %l = "dnn.cross_entropy"(%o, %y) : (tensor<8x4xf32>, tensor<8xi64>) -> tensor<f32>
  return %l : tensor<f32>
}

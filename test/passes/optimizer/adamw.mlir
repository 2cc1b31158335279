// --optimizer appends AdamW (and clipping) to a training step: moments, step and lr become
// arguments, next parameters and moments results; no weight decay on rank-1 parameters.
// RUN: nnscaler-opt --autodiff --optimizer="clip=1.0 weight_decay=0.1" %s | FileCheck %s
// RUN: nnscaler-opt --autodiff --optimizer --plan="dp dp=2" %s | FileCheck %s --check-prefix=PLAN
// RUN: nnscaler-opt --autodiff --optimizer="weight_decay=0.1 no_decay=*.weight" %s | FileCheck %s --check-prefix=GROUPS
// RUN: %not nnscaler-opt --autodiff --optimizer="no_decay=," %s 2>&1 | FileCheck %s --check-prefix=NOPAT
// RUN: %not nnscaler-opt --optimizer %s 2>&1 | FileCheck %s --check-prefix=NOGRAD
// RUN: %not nnscaler-opt --autodiff --optimizer=kind=sgd %s 2>&1 | FileCheck %s --check-prefix=KIND
// RUN: %not nnscaler-opt --autodiff --optimizer=beta1=1.5 %s 2>&1 | FileCheck %s --check-prefix=BETA
// RUN: %not nnscaler-opt --autodiff --optimizer --optimizer %s 2>&1 | FileCheck %s --check-prefix=TWICE

func.func @train(%x: tensor<8x16xf32> {nns.name = "x"}, %y: tensor<8xi64> {nns.name = "y"},
                 %w: tensor<4x16xf32> {nns.name = "head.weight", nns.param},
                 %b: tensor<4xf32> {nns.name = "head.bias", nns.param}) -> (tensor<f32> {nns.name = "loss"}) {
  %o = "dnn.linear"(%x, %w, %b) : (tensor<8x16xf32>, tensor<4x16xf32>, tensor<4xf32>) -> tensor<8x4xf32>
  %l = "dnn.cross_entropy"(%o, %y) : (tensor<8x4xf32>, tensor<8xi64>) -> tensor<f32>
  return %l : tensor<f32>
}

// CHECK: func.func @train(%arg0: tensor<8x16xf32> {nns.name = "x"}, %arg1: tensor<8xi64> {nns.name = "y"}, %arg2: tensor<4x16xf32> {nns.name = "head.weight", nns.param}, %arg3: tensor<4xf32> {nns.name = "head.bias", nns.param},
// CHECK-SAME: %arg4: tensor<4x16xf32> {nns.init = "zeros", nns.name = "adam.m.head.weight", nns.state_of = "head.weight"}
// CHECK-SAME: %arg7: tensor<4xf32> {nns.init = "zeros", nns.name = "adam.v.head.bias", nns.state_of = "head.bias"}, %arg8: tensor<f32> {nns.name = "step"}, %arg9: tensor<f32> {nns.name = "lr"})
// CHECK-SAME: -> (tensor<f32> {nns.name = "loss"}, tensor<4x16xf32> {nns.name = "next.head.weight"}, tensor<4x16xf32> {nns.name = "next.adam.m.head.weight"}
// Clipping: the summed squares of every gradient, the factor, which each update applies.
// CHECK: %[[SQ:.*]] = "dnn.mul"(%[[GW:.*]], %[[GW]])
// CHECK: "dnn.sum"(%[[SQ]]) {dims = array<i64: 0, 1>}
// CHECK: %[[SQB:.*]] = "dnn.mul"(%[[GB:.*]], %[[GB]])
// CHECK: %[[S:.*]] = "dnn.clip_scale"({{.*}}) {max_norm = 1.000000e+00 : f64}
// CHECK: "dnn.adamw"(%arg2, %[[GW]], %arg4, %arg5, %arg9, %arg8, %[[S]]) {{{.*}}weight_decay = 1.000000e-01 : f64}
// CHECK: "dnn.adamw"(%arg3, %[[GB]], %arg6, %arg7, %arg9, %arg8, %[[S]]) {{{.*}}weight_decay = 0.000000e+00 : f64}

// The moments take their parameter's layout; the data is split, the scalars are not.
// PLAN: %arg0: tensor<8x16xf32> {nns.layout = #nns.layout<@world, dp = D(0)>, nns.name = "x"}
// PLAN-SAME: %arg4: tensor<4x16xf32> {nns.init = "zeros", nns.name = "adam.m.head.weight", nns.state_of = "head.weight"}
// PLAN-SAME: %arg8: tensor<f32> {nns.name = "step"}

// NOGRAD: error: optimizer: @train returns no gradients; run --autodiff first
// KIND: optimizer: unknown kind 'sgd' (kinds: adamw)
// BETA: optimizer: 'beta1=1.5' must be in [0, 1)
// TWICE: error: optimizer: @train already has an optimizer

// Parameter groups by name: here the weight matches no_decay and the bias decays.
// GROUPS: "dnn.adamw"(%arg2, {{.*}}weight_decay = 0.000000e+00 : f64}
// GROUPS: "dnn.adamw"(%arg3, {{.*}}weight_decay = 1.000000e-01 : f64}
// NOPAT: optimizer: 'no_decay=,' names no pattern

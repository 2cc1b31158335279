// --place splits the program into contiguous stages of balanced FLOPs; --autodiff gives
// each backward op its forward op's stage.
// RUN: nnscaler-opt --place="stages=2" --autodiff %s 2>%t.err | FileCheck %s
// RUN: FileCheck %s --check-prefix=REMARK < %t.err
// RUN: nnscaler-opt --place="stages=2" --autodiff --print-stats %s -o /dev/null 2>&1 | FileCheck %s --check-prefix=STATS

// --print-stats breaks a placed program down by stage.
// STATS: pipeline stages: 2 (nns.stage)
// STATS-NEXT: stage 0: 2 ops, forward 1.6384e4 FLOPs, backward 1.6384e4 FLOPs, parameters 4.00 KiB, activations 1.00 KiB
// STATS-NEXT: saved for the backward: 1.00 KiB (full recompute 1.00 KiB, selective 1.00 KiB)
// STATS-NEXT: stage 1: 8 ops, forward 2.4960e3 FLOPs, backward 6.2720e3 FLOPs, parameters 512.00 B

// The first linear (16384 FLOPs) outweighs the rest (2496): it is stage 0 alone.
// REMARK: remark: place @train: 2 stages; 0: 1 ops, 1.638e4 FLOPs; 1: 3 ops, 2.496e3 FLOPs; slowest / mean = 1.736

// CHECK-LABEL: func.func @train
// CHECK: "dnn.linear"(%arg0, %arg2) {nns.stage = 0 : i64}
// CHECK-NEXT: "dnn.relu"({{.*}}) {nns.stage = 1 : i64}
// CHECK-NEXT: "dnn.linear"({{.*}}) {nns.stage = 1 : i64}
// CHECK-NEXT: "dnn.cross_entropy"({{.*}}) {nns.stage = 1 : i64}
// The loss seed and the backward of relu and the second linear on stage 1, the first
// linear's on stage 0.
// CHECK-NEXT: "dnn.fill"() {nns.stage = 1 : i64
// CHECK-NEXT: "dnn.cross_entropy_grad"({{.*}}) {nns.stage = 1 : i64}
// CHECK: "dnn.relu_grad"({{.*}}) {nns.stage = 1 : i64}
// CHECK: "dnn.linear_weight_grad"({{.*}}) {nns.stage = 0 : i64}
func.func @train(%x: tensor<8x32xf32> {nns.name = "x"}, %y: tensor<8xi64> {nns.name = "labels"},
                 %w1: tensor<32x32xf32> {nns.name = "fc1.weight", nns.param},
                 %w2: tensor<4x32xf32> {nns.name = "fc2.weight", nns.param}) -> (tensor<f32> {nns.name = "loss"}) {
  %h = "dnn.linear"(%x, %w1) : (tensor<8x32xf32>, tensor<32x32xf32>) -> tensor<8x32xf32>
  %a = "dnn.relu"(%h) : (tensor<8x32xf32>) -> tensor<8x32xf32>
  %l = "dnn.linear"(%a, %w2) : (tensor<8x32xf32>, tensor<4x32xf32>) -> tensor<8x4xf32>
  %loss = "dnn.cross_entropy"(%l, %y) : (tensor<8x4xf32>, tensor<8xi64>) -> tensor<f32>
  return %loss : tensor<f32>
}

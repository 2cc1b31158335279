// A user op whose body calls another user op: check-op, autodiff (derived VJPs of both),
// partitioning (specializations of both) and the run on 4 devices equal to one device.
// RUN: nnscaler check-op %s @lg | FileCheck %s --check-prefix=CHECKOP
// RUN: nnscaler-opt --autodiff %s -o %t.ad.mlir
// RUN: FileCheck %s --check-prefix=AD < %t.ad.mlir
// RUN: nnscaler-opt --autodiff --plan="dp-megatron dp=2 tp=2" --propagate-layouts --split-tensor --lower-relayouts --localize %s -o %t.local.mlir
// RUN: FileCheck %s --check-prefix=LOCAL < %t.local.mlir
// RUN: rm -rf %t.d && mkdir -p %t.d && %python %S/torch_check.py write %t.d
// RUN: nnscaler run %t.ad.mlir --inputs %t.d/batch.safetensors --init-seed 5 -o %t.one.safetensors
// RUN: nnscaler run %t.local.mlir --devices 4 --inputs %t.d/batch.safetensors --init-seed 5 -o %t.four.safetensors
// RUN: %python %S/compare.py %t.four.safetensors %t.one.safetensors | FileCheck %s --check-prefix=EQ

// CHECKOP: ok    split n over 4 devices
// AD: func.func private @act.vjp(
// AD: func.func private @lg.vjp(
// AD: call @act.vjp(
// LOCAL: func.func private @act.local0(
// LOCAL: func.func private @lg.local0(
// LOCAL: call @act.local0(
// EQ: equal within 1e-5

func.func private @act(%y: tensor<8x32xf32>) -> tensor<8x32xf32> attributes {nns.annotation = "m n -> m n"} {
  %z = "dnn.gelu"(%y) : (tensor<8x32xf32>) -> tensor<8x32xf32>
  return %z : tensor<8x32xf32>
}
func.func private @lg(%x: tensor<8x16xf32>, %w: tensor<32x16xf32>) -> tensor<8x32xf32> attributes {nns.annotation = "m k^, n k^ -> m n"} {
  %y = "dnn.linear"(%x, %w) : (tensor<8x16xf32>, tensor<32x16xf32>) -> tensor<8x32xf32>
  %z = func.call @act(%y) : (tensor<8x32xf32>) -> tensor<8x32xf32>
  return %z : tensor<8x32xf32>
}
func.func @train(%x: tensor<8x16xf32> {nns.name = "x"}, %labels: tensor<8xi64> {nns.name = "labels"},
                 %w1: tensor<32x16xf32> {nns.name = "fc1.weight", nns.param},
                 %w2: tensor<4x32xf32> {nns.name = "fc2.weight", nns.param})
    -> (tensor<f32> {nns.name = "loss"}) {
  %h = func.call @lg(%x, %w1) : (tensor<8x16xf32>, tensor<32x16xf32>) -> tensor<8x32xf32>
  %logits = "dnn.linear"(%h, %w2) : (tensor<8x32xf32>, tensor<4x32xf32>) -> tensor<8x4xf32>
  %loss = "dnn.cross_entropy"(%logits, %labels) : (tensor<8x4xf32>, tensor<8xi64>) -> tensor<f32>
  return %loss : tensor<f32>
}

// RUN: nnscaler-opt --print-stats %s -o /dev/null 2>&1 | FileCheck %s
// RUN: nnscaler-opt --pass-pipeline='builtin.module(print-stats{func=train})' %s -o /dev/null 2>&1 | FileCheck %s
// RUN: nnscaler import --preset gpt2-124m | nnscaler-opt --print-stats -o /dev/null - 2>&1 | FileCheck %s --check-prefix=GPT2

// CHECK-LABEL: === nnscaler stats: @train ===
// CHECK: ops: 2
// CHECK-DAG: dnn.linear 1
// CHECK-DAG: dnn.relu 1
// CHECK: parameters: 64 (256.00 B) in 1 tensors
// linear: 2*8*4*16 = 1024 FLOPs, relu: 32; x3 for the training step.
// CHECK: flops per training step: 3.1680e3 (forward x 3: backward estimated as 2x forward; forward 1.0560e3)
// CHECK: activation bytes: 256 (256.00 B, values produced by forward ops)

// GPT-2 small with the LM head tied to the token embedding: 124,439,808 parameters.
// GPT2: parameters: 124,439,808
func.func @train(%x: tensor<8x16xf32> {nns.name = "x"}, %w: tensor<4x16xf32> {nns.name = "w", nns.param}) -> tensor<8x4xf32> {
  %0 = "dnn.linear"(%x, %w) : (tensor<8x16xf32>, tensor<4x16xf32>) -> tensor<8x4xf32>
  %1 = "dnn.relu"(%0) : (tensor<8x4xf32>) -> tensor<8x4xf32>
  return %1 : tensor<8x4xf32>
}

// --autocast=bf16: each matrix product reads bf16 casts of its f32 operands (one cast per
// use) and its bf16 result is cast back to the f32 value the program read before; the
// backward --autodiff derives from the casts runs the products' gradients in bf16 and
// returns f32 gradients. Parameters stay f32.
// RUN: nnscaler-opt --autocast=bf16 %s 2>&1 | FileCheck %s
// RUN: nnscaler-opt --autocast --autodiff %s 2>&1 | FileCheck %s --check-prefix=GRAD
// RUN: nnscaler-opt --autocast --autodiff --print-stats %s -o /dev/null 2>&1 | FileCheck %s --check-prefix=STATS
// RUN: %not nnscaler-opt --autodiff --autocast %s 2>&1 | FileCheck %s --check-prefix=AFTER
// RUN: %not nnscaler-opt --autocast --autocast %s 2>&1 | FileCheck %s --check-prefix=TWICE
// RUN: %not nnscaler-opt --autocast=f16 %s 2>&1 | FileCheck %s --check-prefix=F16
// RUN: %not nnscaler-opt --autocast=fp8 %s 2>&1 | FileCheck %s --check-prefix=BAD
// RUN: %not nnscaler-opt --autocast --autodiff --plan="dp dp=2" --propagate-layouts --split-tensor --lower-relayouts --localize --autocast %s 2>&1 | FileCheck %s --check-prefix=LOCAL
// RUN: nnscaler-opt --autocast="bf16 activations=bf16" %s 2>&1 | FileCheck %s --check-prefix=ACT
// RUN: nnscaler-opt --autocast="bf16 activations=bf16" --autodiff %s 2>&1 | FileCheck %s --check-prefix=ACTGRAD
// RUN: %not nnscaler-opt --autocast="bf16 activations=f16" %s 2>&1 | FileCheck %s --check-prefix=ACTBAD

func.func @train(%x: tensor<8x16xf32> {nns.name = "x"}, %y: tensor<8xi64> {nns.name = "y"},
                 %w0: tensor<16x16xf32> {nns.name = "l.0.w", nns.param},
                 %b0: tensor<16xf32> {nns.name = "l.0.b", nns.param},
                 %wh: tensor<4x16xf32> {nns.name = "head.w", nns.param}) -> (tensor<f32> {nns.name = "loss"}) {
  %h0 = "dnn.linear"(%x, %w0, %b0) : (tensor<8x16xf32>, tensor<16x16xf32>, tensor<16xf32>) -> tensor<8x16xf32>
  %a0 = "dnn.gelu"(%h0) : (tensor<8x16xf32>) -> tensor<8x16xf32>
  %o = "dnn.linear"(%a0, %wh) : (tensor<8x16xf32>, tensor<4x16xf32>) -> tensor<8x4xf32>
  %l = "dnn.cross_entropy"(%o, %y) : (tensor<8x4xf32>, tensor<8xi64>) -> tensor<f32>
  return %l : tensor<f32>
}

// CHECK: remark: autocast @train: 2 matrix products in bf16
// CHECK: %[[X:.*]] = "dnn.cast"(%arg0) {to = "bf16"} : (tensor<8x16xf32>) -> tensor<8x16xbf16>
// CHECK-NEXT: %[[W:.*]] = "dnn.cast"(%arg2) {to = "bf16"} : (tensor<16x16xf32>) -> tensor<16x16xbf16>
// CHECK-NEXT: %[[B:.*]] = "dnn.cast"(%arg3) {to = "bf16"} : (tensor<16xf32>) -> tensor<16xbf16>
// CHECK-NEXT: %[[H:.*]] = "dnn.linear"(%[[X]], %[[W]], %[[B]]) : (tensor<8x16xbf16>, tensor<16x16xbf16>, tensor<16xbf16>) -> tensor<8x16xbf16>
// CHECK-NEXT: %[[H32:.*]] = "dnn.cast"(%[[H]]) {to = "f32"} : (tensor<8x16xbf16>) -> tensor<8x16xf32>
// CHECK-NEXT: %[[A:.*]] = "dnn.gelu"(%[[H32]]) : (tensor<8x16xf32>) -> tensor<8x16xf32>
// CHECK-NEXT: "dnn.cast"(%[[A]]) {to = "bf16"}
// CHECK-NEXT: "dnn.cast"(%arg4) {to = "bf16"}
// CHECK-NEXT: "dnn.linear"
// CHECK-NEXT: %[[O:.*]] = "dnn.cast"({{.*}}) {to = "f32"} : (tensor<8x4xbf16>) -> tensor<8x4xf32>
// CHECK-NEXT: "dnn.cross_entropy"(%[[O]], %arg1) : (tensor<8x4xf32>, tensor<8xi64>) -> tensor<f32>

// The backward: the loss gradient is cast to bf16 for the head's products, their results
// back to f32; the gradients returned are f32.
// GRAD: "dnn.cross_entropy_grad"
// GRAD-NEXT: %[[D:.*]] = "dnn.cast"({{.*}}) {to = "bf16"} : (tensor<8x4xf32>) -> tensor<8x4xbf16>
// GRAD-NEXT: "dnn.matmul"(%[[D]], {{.*}}) : (tensor<8x4xbf16>, tensor<4x16xbf16>) -> tensor<8x16xbf16>
// GRAD-NEXT: %[[DW:.*]] = "dnn.linear_weight_grad"(%[[D]], {{.*}}) : (tensor<8x4xbf16>, tensor<8x16xbf16>) -> tensor<4x16xbf16>
// GRAD-NEXT: "dnn.cast"(%[[DW]]) {to = "f32"} : (tensor<4x16xbf16>) -> tensor<4x16xf32>
// GRAD: "dnn.sum"({{.*}}) {dims = array<i64: 0>} : (tensor<8x16xbf16>) -> tensor<16xbf16>
// GRAD: return {{.*}} : tensor<f32>, tensor<16x16xf32>, tensor<16xf32>, tensor<4x16xf32>

// bf16 values count two bytes: what the backward keeps shrinks.
// STATS: saved for the backward:

// AFTER: error: autocast: @train has a backward; run --autocast before --autodiff, so that the backward is derived from the casts
// TWICE: error: autocast: @train already has casts (autocast runs once)
// F16: autocast: f16 needs loss scaling, which nnscaler does not do; use bf16
// BAD: autocast: unknown type 'fp8' (types: bf16)
// LOCAL: error: autocast: the function is localized; cast before --localize (and before --autodiff)

// activations=bf16: the GELU between the products reads and writes bf16 (no casts around
// it); the logits are cast to f32 for the loss, which stays f32.
// ACT: remark: autocast @train: 3 ops (every activation) in bf16
// ACT: %[[H:.*]] = "dnn.linear"({{.*}}) : (tensor<8x16xbf16>, tensor<16x16xbf16>, tensor<16xbf16>) -> tensor<8x16xbf16>
// ACT-NEXT: %[[A:.*]] = "dnn.gelu"(%[[H]]) : (tensor<8x16xbf16>) -> tensor<8x16xbf16>
// ACT-NEXT: %[[W:.*]] = "dnn.cast"(%arg4) {to = "bf16"}
// ACT-NEXT: %[[O:.*]] = "dnn.linear"(%[[A]], %[[W]]) : (tensor<8x16xbf16>, tensor<4x16xbf16>) -> tensor<8x4xbf16>
// ACT-NEXT: %[[O32:.*]] = "dnn.cast"(%[[O]]) {to = "f32"} : (tensor<8x4xbf16>) -> tensor<8x4xf32>
// ACT-NEXT: "dnn.cross_entropy"(%[[O32]], %arg1) : (tensor<8x4xf32>, tensor<8xi64>) -> tensor<f32>

// Its backward: the GELU's gradient in bf16, the parameters' gradients cast to f32.
// ACTGRAD: "dnn.gelu_grad"({{.*}}) : (tensor<8x16xbf16>, tensor<8x16xbf16>) -> tensor<8x16xbf16>
// ACTGRAD: return {{.*}} : tensor<f32>, tensor<16x16xf32>, tensor<16xf32>, tensor<4x16xf32>
// ACTBAD: autocast: 'activations=f16' must be f32 (only the matrix products in bf16) or bf16 (every activation)

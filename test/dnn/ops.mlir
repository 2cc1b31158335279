// Round trip of every dnn op and nns collective: print, re-parse, print again; the
// result must also parse with upstream mlir-opt-19. Generated from the OpSpec examples;
// tools/tests/coverage.rs checks that every registered op appears here.
// RUN: nnscaler-opt --split-input-file %s | nnscaler-opt --split-input-file - | FileCheck %s
// RUN: nnscaler-opt --split-input-file %s | mlir-opt --allow-unregistered-dialect --split-input-file | FileCheck %s

// CHECK-LABEL: func.func @dnn_matmul
// CHECK: "dnn.matmul"({{.*}}) {{.*}}: (tensor<4x8xf32>, tensor<8x16xf32>) -> tensor<4x16xf32>
func.func @dnn_matmul(%a0: tensor<4x8xf32>, %a1: tensor<8x16xf32>) {
  %2 = "dnn.matmul"(%a0, %a1) : (tensor<4x8xf32>, tensor<8x16xf32>) -> tensor<4x16xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_linear
// CHECK: "dnn.linear"({{.*}}) {{.*}}: (tensor<2x3x8xf32>, tensor<16x8xf32>, tensor<16xf32>) -> tensor<2x3x16xf32>
func.func @dnn_linear(%a0: tensor<2x3x8xf32>, %a1: tensor<16x8xf32>, %a2: tensor<16xf32>) {
  %3 = "dnn.linear"(%a0, %a1, %a2) : (tensor<2x3x8xf32>, tensor<16x8xf32>, tensor<16xf32>) -> tensor<2x3x16xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_add
// CHECK: "dnn.add"({{.*}}) {{.*}}: (tensor<2x3xf32>, tensor<3xf32>) -> tensor<2x3xf32>
func.func @dnn_add(%a0: tensor<2x3xf32>, %a1: tensor<3xf32>) {
  %2 = "dnn.add"(%a0, %a1) : (tensor<2x3xf32>, tensor<3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_sub
// CHECK: "dnn.sub"({{.*}}) {{.*}}: (tensor<2x3xf32>, tensor<2x1xf32>) -> tensor<2x3xf32>
func.func @dnn_sub(%a0: tensor<2x3xf32>, %a1: tensor<2x1xf32>) {
  %2 = "dnn.sub"(%a0, %a1) : (tensor<2x3xf32>, tensor<2x1xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_mul
// CHECK: "dnn.mul"({{.*}}) {{.*}}: (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_mul(%a0: tensor<2x3xf32>, %a1: tensor<2x3xf32>) {
  %2 = "dnn.mul"(%a0, %a1) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_div
// CHECK: "dnn.div"({{.*}}) {{.*}}: (tensor<2x3xf32>, tensor<f32>) -> tensor<2x3xf32>
func.func @dnn_div(%a0: tensor<2x3xf32>, %a1: tensor<f32>) {
  %2 = "dnn.div"(%a0, %a1) : (tensor<2x3xf32>, tensor<f32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_neg
// CHECK: "dnn.neg"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_neg(%a0: tensor<2x3xf32>) {
  %1 = "dnn.neg"(%a0) : (tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_exp
// CHECK: "dnn.exp"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_exp(%a0: tensor<2x3xf32>) {
  %1 = "dnn.exp"(%a0) : (tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_log
// CHECK: "dnn.log"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_log(%a0: tensor<2x3xf32>) {
  %1 = "dnn.log"(%a0) : (tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_sqrt
// CHECK: "dnn.sqrt"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_sqrt(%a0: tensor<2x3xf32>) {
  %1 = "dnn.sqrt"(%a0) : (tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_rsqrt
// CHECK: "dnn.rsqrt"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_rsqrt(%a0: tensor<2x3xf32>) {
  %1 = "dnn.rsqrt"(%a0) : (tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_abs
// CHECK: "dnn.abs"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_abs(%a0: tensor<2x3xf32>) {
  %1 = "dnn.abs"(%a0) : (tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_sigmoid
// CHECK: "dnn.sigmoid"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_sigmoid(%a0: tensor<2x3xf32>) {
  %1 = "dnn.sigmoid"(%a0) : (tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_tanh
// CHECK: "dnn.tanh"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_tanh(%a0: tensor<2x3xf32>) {
  %1 = "dnn.tanh"(%a0) : (tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_gelu
// CHECK: "dnn.gelu"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_gelu(%a0: tensor<2x3xf32>) {
  %1 = "dnn.gelu"(%a0) {approximate = "tanh"} : (tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_silu
// CHECK: "dnn.silu"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_silu(%a0: tensor<2x3xf32>) {
  %1 = "dnn.silu"(%a0) : (tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_relu
// CHECK: "dnn.relu"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_relu(%a0: tensor<2x3xf32>) {
  %1 = "dnn.relu"(%a0) : (tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_softmax
// CHECK: "dnn.softmax"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_softmax(%a0: tensor<2x3xf32>) {
  %1 = "dnn.softmax"(%a0) {dim = -1 : i64} : (tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_log_softmax
// CHECK: "dnn.log_softmax"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_log_softmax(%a0: tensor<2x3xf32>) {
  %1 = "dnn.log_softmax"(%a0) {dim = 1 : i64} : (tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_layer_norm
// CHECK: "dnn.layer_norm"({{.*}}) {{.*}}: (tensor<2x3x8xf32>, tensor<8xf32>, tensor<8xf32>) -> tensor<2x3x8xf32>
func.func @dnn_layer_norm(%a0: tensor<2x3x8xf32>, %a1: tensor<8xf32>, %a2: tensor<8xf32>) {
  %3 = "dnn.layer_norm"(%a0, %a1, %a2) {eps = 1.0e-5 : f64} : (tensor<2x3x8xf32>, tensor<8xf32>, tensor<8xf32>) -> tensor<2x3x8xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_rms_norm
// CHECK: "dnn.rms_norm"({{.*}}) {{.*}}: (tensor<2x3x8xf32>, tensor<8xf32>) -> tensor<2x3x8xf32>
func.func @dnn_rms_norm(%a0: tensor<2x3x8xf32>, %a1: tensor<8xf32>) {
  %2 = "dnn.rms_norm"(%a0, %a1) {eps = 1.0e-5 : f64} : (tensor<2x3x8xf32>, tensor<8xf32>) -> tensor<2x3x8xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_embedding
// CHECK: "dnn.embedding"({{.*}}) {{.*}}: (tensor<2x3xi64>, tensor<65x8xf32>) -> tensor<2x3x8xf32>
func.func @dnn_embedding(%a0: tensor<2x3xi64>, %a1: tensor<65x8xf32>) {
  %2 = "dnn.embedding"(%a0, %a1) : (tensor<2x3xi64>, tensor<65x8xf32>) -> tensor<2x3x8xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_reshape
// CHECK: "dnn.reshape"({{.*}}) {{.*}}: (tensor<2x3x8xf32>) -> tensor<2x3x2x4xf32>
func.func @dnn_reshape(%a0: tensor<2x3x8xf32>) {
  %1 = "dnn.reshape"(%a0) {shape = array<i64: 2, 3, 2, 4>} : (tensor<2x3x8xf32>) -> tensor<2x3x2x4xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_transpose
// CHECK: "dnn.transpose"({{.*}}) {{.*}}: (tensor<2x3x8xf32>) -> tensor<2x8x3xf32>
func.func @dnn_transpose(%a0: tensor<2x3x8xf32>) {
  %1 = "dnn.transpose"(%a0) {perm = array<i64: 0, 2, 1>} : (tensor<2x3x8xf32>) -> tensor<2x8x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_slice
// CHECK: "dnn.slice"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<2x2xf32>
func.func @dnn_slice(%a0: tensor<2x3xf32>) {
  %1 = "dnn.slice"(%a0) {dim = 1 : i64, start = 1 : i64, end = 3 : i64} : (tensor<2x3xf32>) -> tensor<2x2xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_concat
// CHECK: "dnn.concat"({{.*}}) {{.*}}: (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x6xf32>
func.func @dnn_concat(%a0: tensor<2x3xf32>, %a1: tensor<2x3xf32>) {
  %2 = "dnn.concat"(%a0, %a1) {dim = 1 : i64} : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x6xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_split
// CHECK: "dnn.split"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> (tensor<2x1xf32>, tensor<2x2xf32>)
func.func @dnn_split(%a0: tensor<2x3xf32>) {
  %1:2 = "dnn.split"(%a0) {dim = 1 : i64, sizes = array<i64: 1, 2>} : (tensor<2x3xf32>) -> (tensor<2x1xf32>, tensor<2x2xf32>)
  return
}
// -----

// CHECK-LABEL: func.func @dnn_sum
// CHECK: "dnn.sum"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<2xf32>
func.func @dnn_sum(%a0: tensor<2x3xf32>) {
  %1 = "dnn.sum"(%a0) {dims = array<i64: 1>} : (tensor<2x3xf32>) -> tensor<2xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_mean
// CHECK: "dnn.mean"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<f32>
func.func @dnn_mean(%a0: tensor<2x3xf32>) {
  %1 = "dnn.mean"(%a0) {dims = array<i64: 0, 1>} : (tensor<2x3xf32>) -> tensor<f32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_max
// CHECK: "dnn.max"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<2x1xf32>
func.func @dnn_max(%a0: tensor<2x3xf32>) {
  %1 = "dnn.max"(%a0) {dims = array<i64: 1>, keepdim = true} : (tensor<2x3xf32>) -> tensor<2x1xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_attention
// CHECK: "dnn.attention"({{.*}}) {{.*}}: (tensor<2x4x16x8xf32>, tensor<2x2x16x8xf32>, tensor<2x2x16x8xf32>) -> tensor<2x4x16x8xf32>
func.func @dnn_attention(%a0: tensor<2x4x16x8xf32>, %a1: tensor<2x2x16x8xf32>, %a2: tensor<2x2x16x8xf32>) {
  %3 = "dnn.attention"(%a0, %a1, %a2) {causal = true} : (tensor<2x4x16x8xf32>, tensor<2x2x16x8xf32>, tensor<2x2x16x8xf32>) -> tensor<2x4x16x8xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_rotary
// CHECK: "dnn.rotary"({{.*}}) {{.*}}: (tensor<2x4x16x8xf32>) -> tensor<2x4x16x8xf32>
func.func @dnn_rotary(%a0: tensor<2x4x16x8xf32>) {
  %1 = "dnn.rotary"(%a0) {theta = 5.0e+5 : f64} : (tensor<2x4x16x8xf32>) -> tensor<2x4x16x8xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_cross_entropy
// CHECK: "dnn.cross_entropy"({{.*}}) {{.*}}: (tensor<2x3x65xf32>, tensor<2x3xi64>) -> tensor<f32>
func.func @dnn_cross_entropy(%a0: tensor<2x3x65xf32>, %a1: tensor<2x3xi64>) {
  %2 = "dnn.cross_entropy"(%a0, %a1) : (tensor<2x3x65xf32>, tensor<2x3xi64>) -> tensor<f32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_dropout
// CHECK: "dnn.dropout"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_dropout(%a0: tensor<2x3xf32>) {
  %1 = "dnn.dropout"(%a0) {p = 1.0e-1 : f64, seed = 7 : i64} : (tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_fill
// CHECK: "dnn.fill"({{.*}}) {{.*}}: () -> tensor<2x3xf32>
func.func @dnn_fill() {
  %0 = "dnn.fill"() {shape = array<i64: 2, 3>, value = 1.0 : f64} : () -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_adamw
// CHECK: "dnn.adamw"({{.*}}) {{.*}}: (tensor<2x3xf32>, tensor<2x3xf32>, tensor<2x3xf32>, tensor<2x3xf32>, tensor<f32>, tensor<f32>) -> (tensor<2x3xf32>, tensor<2x3xf32>, tensor<2x3xf32>)
func.func @dnn_adamw(%a0: tensor<2x3xf32>, %a1: tensor<2x3xf32>, %a2: tensor<2x3xf32>, %a4: tensor<f32>) {
  %3:3 = "dnn.adamw"(%a0, %a1, %a2, %a2, %a4, %a4) {beta1 = 9.0e-01 : f64, beta2 = 9.99e-01 : f64, eps = 1.0e-08 : f64, weight_decay = 1.0e-01 : f64} : (tensor<2x3xf32>, tensor<2x3xf32>, tensor<2x3xf32>, tensor<2x3xf32>, tensor<f32>, tensor<f32>) -> (tensor<2x3xf32>, tensor<2x3xf32>, tensor<2x3xf32>)
  return
}
// -----

// CHECK-LABEL: func.func @dnn_clip_scale
// CHECK: "dnn.clip_scale"({{.*}}) {{.*}}: (tensor<f32>) -> tensor<f32>
func.func @dnn_clip_scale(%a0: tensor<f32>) {
  %1 = "dnn.clip_scale"(%a0) {max_norm = 1.0 : f64} : (tensor<f32>) -> tensor<f32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_gelu_grad
// CHECK: "dnn.gelu_grad"({{.*}}) {{.*}}: (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_gelu_grad(%a0: tensor<2x3xf32>, %a1: tensor<2x3xf32>) {
  %2 = "dnn.gelu_grad"(%a0, %a1) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_silu_grad
// CHECK: "dnn.silu_grad"({{.*}}) {{.*}}: (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_silu_grad(%a0: tensor<2x3xf32>, %a1: tensor<2x3xf32>) {
  %2 = "dnn.silu_grad"(%a0, %a1) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_relu_grad
// CHECK: "dnn.relu_grad"({{.*}}) {{.*}}: (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_relu_grad(%a0: tensor<2x3xf32>, %a1: tensor<2x3xf32>) {
  %2 = "dnn.relu_grad"(%a0, %a1) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_tanh_grad
// CHECK: "dnn.tanh_grad"({{.*}}) {{.*}}: (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_tanh_grad(%a0: tensor<2x3xf32>, %a1: tensor<2x3xf32>) {
  %2 = "dnn.tanh_grad"(%a0, %a1) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_softmax_grad
// CHECK: "dnn.softmax_grad"({{.*}}) {{.*}}: (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_softmax_grad(%a0: tensor<2x3xf32>, %a1: tensor<2x3xf32>) {
  %2 = "dnn.softmax_grad"(%a0, %a1) {dim = -1 : i64} : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_log_softmax_grad
// CHECK: "dnn.log_softmax_grad"({{.*}}) {{.*}}: (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_log_softmax_grad(%a0: tensor<2x3xf32>, %a1: tensor<2x3xf32>) {
  %2 = "dnn.log_softmax_grad"(%a0, %a1) {dim = -1 : i64} : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_layer_norm_grad
// CHECK: "dnn.layer_norm_grad"({{.*}}) {{.*}}: (tensor<2x3x8xf32>, tensor<2x3x8xf32>, tensor<8xf32>) -> (tensor<2x3x8xf32>, tensor<8xf32>, tensor<8xf32>)
func.func @dnn_layer_norm_grad(%a0: tensor<2x3x8xf32>, %a1: tensor<2x3x8xf32>, %a2: tensor<8xf32>) {
  %3:3 = "dnn.layer_norm_grad"(%a0, %a1, %a2) : (tensor<2x3x8xf32>, tensor<2x3x8xf32>, tensor<8xf32>) -> (tensor<2x3x8xf32>, tensor<8xf32>, tensor<8xf32>)
  return
}
// -----

// CHECK-LABEL: func.func @dnn_rms_norm_grad
// CHECK: "dnn.rms_norm_grad"({{.*}}) {{.*}}: (tensor<2x3x8xf32>, tensor<2x3x8xf32>, tensor<8xf32>) -> (tensor<2x3x8xf32>, tensor<8xf32>)
func.func @dnn_rms_norm_grad(%a0: tensor<2x3x8xf32>, %a1: tensor<2x3x8xf32>, %a2: tensor<8xf32>) {
  %3:2 = "dnn.rms_norm_grad"(%a0, %a1, %a2) : (tensor<2x3x8xf32>, tensor<2x3x8xf32>, tensor<8xf32>) -> (tensor<2x3x8xf32>, tensor<8xf32>)
  return
}
// -----

// CHECK-LABEL: func.func @dnn_embedding_grad
// CHECK: "dnn.embedding_grad"({{.*}}) {{.*}}: (tensor<2x3x8xf32>, tensor<2x3xi64>) -> tensor<65x8xf32>
func.func @dnn_embedding_grad(%a0: tensor<2x3x8xf32>, %a1: tensor<2x3xi64>) {
  %2 = "dnn.embedding_grad"(%a0, %a1) {vocab = 65 : i64} : (tensor<2x3x8xf32>, tensor<2x3xi64>) -> tensor<65x8xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_linear_weight_grad
// CHECK: "dnn.linear_weight_grad"({{.*}}) : (tensor<2x3x16xf32>, tensor<2x3x8xf32>) -> tensor<16x8xf32>
func.func @dnn_linear_weight_grad(%a0: tensor<2x3x16xf32>, %a1: tensor<2x3x8xf32>) {
  %2 = "dnn.linear_weight_grad"(%a0, %a1) : (tensor<2x3x16xf32>, tensor<2x3x8xf32>) -> tensor<16x8xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_attention_grad
// CHECK: "dnn.attention_grad"({{.*}}) {{.*}}: (tensor<2x4x16x8xf32>, tensor<2x4x16x8xf32>, tensor<2x4x16x8xf32>, tensor<2x4x16x8xf32>) -> (tensor<2x4x16x8xf32>, tensor<2x4x16x8xf32>, tensor<2x4x16x8xf32>)
func.func @dnn_attention_grad(%a0: tensor<2x4x16x8xf32>, %a1: tensor<2x4x16x8xf32>, %a2: tensor<2x4x16x8xf32>, %a3: tensor<2x4x16x8xf32>) {
  %4:3 = "dnn.attention_grad"(%a0, %a1, %a2, %a3) {causal = true} : (tensor<2x4x16x8xf32>, tensor<2x4x16x8xf32>, tensor<2x4x16x8xf32>, tensor<2x4x16x8xf32>) -> (tensor<2x4x16x8xf32>, tensor<2x4x16x8xf32>, tensor<2x4x16x8xf32>)
  return
}
// -----

// CHECK-LABEL: func.func @dnn_rotary_grad
// CHECK: "dnn.rotary_grad"({{.*}}) {{.*}}: (tensor<2x4x16x8xf32>) -> tensor<2x4x16x8xf32>
func.func @dnn_rotary_grad(%a0: tensor<2x4x16x8xf32>) {
  %1 = "dnn.rotary_grad"(%a0) : (tensor<2x4x16x8xf32>) -> tensor<2x4x16x8xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_pick
// CHECK: "dnn.pick"({{.*}}) {{.*}}: (tensor<6x5xf32>, tensor<6xi64>) -> tensor<6xf32>
func.func @dnn_pick(%a0: tensor<6x5xf32>, %a1: tensor<6xi64>) {
  %2 = "dnn.pick"(%a0, %a1) : (tensor<6x5xf32>, tensor<6xi64>) -> tensor<6xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_pick_grad
// CHECK: "dnn.pick_grad"({{.*}}) {{.*}}: (tensor<6xf32>, tensor<6xi64>) -> tensor<6x5xf32>
func.func @dnn_pick_grad(%a0: tensor<6xf32>, %a1: tensor<6xi64>) {
  %2 = "dnn.pick_grad"(%a0, %a1) {classes = 5 : i64} : (tensor<6xf32>, tensor<6xi64>) -> tensor<6x5xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_softmax_xent_grad
// CHECK: "dnn.softmax_xent_grad"({{.*}}) {{.*}}: (tensor<f32>, tensor<6x5xf32>, tensor<6xi64>, tensor<6x1xf32>) -> tensor<6x5xf32>
func.func @dnn_softmax_xent_grad(%a0: tensor<f32>, %a1: tensor<6x5xf32>, %a2: tensor<6xi64>, %a3: tensor<6x1xf32>) {
  %4 = "dnn.softmax_xent_grad"(%a0, %a1, %a2, %a3) : (tensor<f32>, tensor<6x5xf32>, tensor<6xi64>, tensor<6x1xf32>) -> tensor<6x5xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_cross_entropy_grad
// CHECK: "dnn.cross_entropy_grad"({{.*}}) {{.*}}: (tensor<f32>, tensor<6x65xf32>, tensor<6xi64>) -> tensor<6x65xf32>
func.func @dnn_cross_entropy_grad(%a0: tensor<f32>, %a1: tensor<6x65xf32>, %a2: tensor<6xi64>) {
  %3 = "dnn.cross_entropy_grad"(%a0, %a1, %a2) : (tensor<f32>, tensor<6x65xf32>, tensor<6xi64>) -> tensor<6x65xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_broadcast_to
// CHECK: "dnn.broadcast_to"({{.*}}) {{.*}}: (tensor<2x1xf32>) -> tensor<4x2x3xf32>
func.func @dnn_broadcast_to(%a0: tensor<2x1xf32>) {
  %1 = "dnn.broadcast_to"(%a0) {shape = array<i64: 4, 2, 3>} : (tensor<2x1xf32>) -> tensor<4x2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_max_grad
// CHECK: "dnn.max_grad"({{.*}}) {{.*}}: (tensor<2xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
func.func @dnn_max_grad(%a0: tensor<2xf32>, %a1: tensor<2x3xf32>) {
  %2 = "dnn.max_grad"(%a0, %a1) {dims = array<i64: 1>} : (tensor<2xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_pad
// CHECK: "dnn.pad"({{.*}}) {{.*}}: (tensor<2x2xf32>) -> tensor<2x3xf32>
func.func @dnn_pad(%a0: tensor<2x2xf32>) {
  %1 = "dnn.pad"(%a0) {dim = 1 : i64, before = 1 : i64, after = 0 : i64} : (tensor<2x2xf32>) -> tensor<2x3xf32>
  return
}
// -----

// CHECK-LABEL: func.func @dnn_cast
// CHECK: "dnn.cast"({{.*}}) {{.*}}: (tensor<2x3xf32>) -> tensor<2x3xbf16>
func.func @dnn_cast(%a0: tensor<2x3xf32>) {
  %1 = "dnn.cast"(%a0) {to = "bf16"} : (tensor<2x3xf32>) -> tensor<2x3xbf16>
  return
}
// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
// CHECK-LABEL: func.func @nns_all_reduce
// CHECK: "nns.all_reduce"({{.*}}) {{.*}}: (tensor<4x8xf32>) -> tensor<4x8xf32>
func.func @nns_all_reduce(%a0: tensor<4x8xf32>) {
  %1 = "nns.all_reduce"(%a0) {axes = ["tp"], reduce = "sum"} : (tensor<4x8xf32>) -> tensor<4x8xf32>
  return
}
// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
// CHECK-LABEL: func.func @nns_all_gather
// CHECK: "nns.all_gather"({{.*}}) {{.*}}: (tensor<4x8xf32>) -> tensor<4x8xf32>
func.func @nns_all_gather(%a0: tensor<4x8xf32>) {
  %1 = "nns.all_gather"(%a0) {axes = ["tp"], dim = 1 : i64} : (tensor<4x8xf32>) -> tensor<4x8xf32>
  return
}
// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
// CHECK-LABEL: func.func @nns_reduce_scatter
// CHECK: "nns.reduce_scatter"({{.*}}) {{.*}}: (tensor<4x8xf32>) -> tensor<4x8xf32>
func.func @nns_reduce_scatter(%a0: tensor<4x8xf32>) {
  %1 = "nns.reduce_scatter"(%a0) {axes = ["dp", "tp"], dim = 1 : i64} : (tensor<4x8xf32>) -> tensor<4x8xf32>
  return
}
// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
// CHECK-LABEL: func.func @nns_all_to_all
// CHECK: "nns.all_to_all"({{.*}}) {{.*}}: (tensor<4x8xf32>) -> tensor<4x8xf32>
func.func @nns_all_to_all(%a0: tensor<4x8xf32>) {
  %1 = "nns.all_to_all"(%a0) {axes = ["tp"], split_dim = 0 : i64, concat_dim = 1 : i64} : (tensor<4x8xf32>) -> tensor<4x8xf32>
  return
}
// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
// CHECK-LABEL: func.func @nns_broadcast
// CHECK: "nns.broadcast"({{.*}}) {{.*}}: (tensor<4x8xf32>) -> tensor<4x8xf32>
func.func @nns_broadcast(%a0: tensor<4x8xf32>) {
  %1 = "nns.broadcast"(%a0) {axes = ["dp"], root = 0 : i64} : (tensor<4x8xf32>) -> tensor<4x8xf32>
  return
}
// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
// CHECK-LABEL: func.func @nns_slice
// CHECK: "nns.slice"({{.*}}) {{.*}}: (tensor<4x8xf32>) -> tensor<4x8xf32>
func.func @nns_slice(%a0: tensor<4x8xf32>) {
  %1 = "nns.slice"(%a0) {axes = ["tp"], dim = 1 : i64} : (tensor<4x8xf32>) -> tensor<4x8xf32>
  return
}
// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
// CHECK-LABEL: func.func @nns_partition
// CHECK: "nns.partition"({{.*}}) {{.*}}: (tensor<4x8xf32>) -> tensor<4x8xf32>
func.func @nns_partition(%a0: tensor<4x8xf32>) {
  %1 = "nns.partition"(%a0) {axes = ["tp"]} : (tensor<4x8xf32>) -> tensor<4x8xf32>
  return
}
// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
// CHECK-LABEL: func.func @nns_transfer
// CHECK: "nns.transfer"({{.*}}) {{.*}}: (tensor<4x8xf32>) -> tensor<4x8xf32>
func.func @nns_transfer(%a0: tensor<4x8xf32>) {
  %1 = "nns.transfer"(%a0) {from = 0 : i64, to = 1 : i64} : (tensor<4x8xf32>) -> tensor<4x8xf32>
  return
}
// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<pp = 2, dp = 2, mb = 4 (microbatches)>} : () -> ()
// CHECK-LABEL: func.func @nns_microbatch
// CHECK: "nns.microbatch"({{.*}}) {{.*}}: (tensor<8x16xf32>) -> tensor<8x16xf32>
func.func @nns_microbatch(%a0: tensor<8x16xf32>) {
  %1 = "nns.microbatch"(%a0) {axes = ["mb"], dim = 0 : i64, index = 1 : i64} : (tensor<8x16xf32>) -> tensor<8x16xf32>
  return
}
// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<pp = 2, dp = 2>} : () -> ()
// CHECK-LABEL: func.func @nns_send
// CHECK: "nns.send"({{.*}}) {{.*}}: (tensor<4x8xf32>) -> ()
func.func @nns_send(%a0: tensor<4x8xf32>) {
  "nns.send"(%a0) {axis = "pp", peer = 1 : i64, tag = "v12.mb0"} : (tensor<4x8xf32>) -> ()
  return
}
// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<pp = 2, dp = 2>} : () -> ()
// CHECK-LABEL: func.func @nns_recv
// CHECK: "nns.recv"() {{.*}}: () -> tensor<4x8xf32>
func.func @nns_recv() {
  %0 = "nns.recv"() {axis = "pp", peer = 0 : i64, tag = "v12.mb0"} : () -> tensor<4x8xf32>
  return
}
// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
// CHECK-LABEL: func.func @nns_relayout
// CHECK: "nns.relayout"({{.*}}) {{.*}}: (tensor<4x8xf32>) -> tensor<4x8xf32>
func.func @nns_relayout(%a0: tensor<4x8xf32>) {
  %1 = "nns.relayout"(%a0) {to = #nns.layout<@world, tp = D(1)>} : (tensor<4x8xf32>) -> tensor<4x8xf32>
  return
}

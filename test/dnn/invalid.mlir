// Every dnn verifier error, located. (nns errors: test/nns/invalid.mlir)
// RUN: nnscaler-opt --split-input-file --verify-diagnostics %s

func.func @operand_count(%a: tensor<4x8xf32>) {
  // expected-error @+1 {{'dnn.matmul' expects 2 operand(s) (lhs, rhs) but has 1}}
  %0 = "dnn.matmul"(%a) : (tensor<4x8xf32>) -> tensor<4x8xf32>
  return
}

// -----

func.func @optional_operand(%a: tensor<4x8xf32>) {
  // expected-error @+1 {{'dnn.linear' expects 2 to 3 operand(s) (x, weight, bias) but has 1}}
  %0 = "dnn.linear"(%a) : (tensor<4x8xf32>) -> tensor<4x8xf32>
  return
}

// -----

func.func @shape_mismatch(%a: tensor<4x8xf32>, %b: tensor<7x16xf32>) {
  // expected-error @+1 {{dimension 'k' is 8 in operand 0 dim 1 but 7 in operand 1 dim 0}}
  %0 = "dnn.matmul"(%a, %b) : (tensor<4x8xf32>, tensor<7x16xf32>) -> tensor<4x16xf32>
  return
}

// -----

func.func @result_type(%a: tensor<4x8xf32>) {
  // expected-error @+1 {{'dnn.relu' result 0 has type tensor<4x9xf32> but its operands give tensor<4x8xf32>}}
  %0 = "dnn.relu"(%a) : (tensor<4x8xf32>) -> tensor<4x9xf32>
  return
}

// -----

func.func @result_count(%a: tensor<4x8xf32>) {
  // expected-error @+1 {{'dnn.relu' must have 1 result(s) but has 2}}
  %0:2 = "dnn.relu"(%a) : (tensor<4x8xf32>) -> (tensor<4x8xf32>, tensor<4x8xf32>)
  return
}

// -----

func.func @unknown_op(%a: tensor<4x8xf32>) {
  // expected-error @+1 {{'dnn.frobnicate' is not a dnn op}}
  %0 = "dnn.frobnicate"(%a) : (tensor<4x8xf32>) -> tensor<4x8xf32>
  return
}

// -----

func.func @float_ids(%ids: tensor<4xf32>, %t: tensor<10x8xf32>) {
  // expected-error @+1 {{operand 0 (ids) must hold integers, not f32}}
  %0 = "dnn.embedding"(%ids, %t) : (tensor<4xf32>, tensor<10x8xf32>) -> tensor<4x8xf32>
  return
}

// -----

func.func @int_data(%a: tensor<4xi64>) {
  // expected-error @+1 {{operand 0 (x) must hold floats, not i64}}
  %0 = "dnn.relu"(%a) : (tensor<4xi64>) -> tensor<4xi64>
  return
}

// -----

func.func @dynamic(%a: tensor<?x8xf32>) {
  // expected-error @+1 {{operand 0 (x) must be a ranked tensor with a static shape}}
  %0 = "dnn.relu"(%a) : (tensor<?x8xf32>) -> tensor<?x8xf32>
  return
}

// -----

func.func @missing_attr(%a: tensor<4x8xf32>) {
  // expected-error @+1 {{requires integer array attribute 'shape'}}
  %0 = "dnn.reshape"(%a) : (tensor<4x8xf32>) -> tensor<32xf32>
  return
}

// -----

func.func @attr_kind(%a: tensor<4x8xf32>) {
  // expected-error @+1 {{attribute 'perm' must be integer array but is string}}
  %0 = "dnn.transpose"(%a) {perm = "10"} : (tensor<4x8xf32>) -> tensor<8x4xf32>
  return
}

// -----

func.func @bad_reshape(%a: tensor<4x8xf32>) {
  // expected-error @+1 {{cannot reshape [4, 8] (32 elements) to [5, 6] (30 elements)}}
  %0 = "dnn.reshape"(%a) {shape = array<i64: 5, 6>} : (tensor<4x8xf32>) -> tensor<5x6xf32>
  return
}

// -----

func.func @bad_perm(%a: tensor<4x8xf32>) {
  // expected-error @+1 {{attribute 'perm' [0, 0] is not a permutation of 0..2}}
  %0 = "dnn.transpose"(%a) {perm = array<i64: 0, 0>} : (tensor<4x8xf32>) -> tensor<4x4xf32>
  return
}

// -----

func.func @no_broadcast(%a: tensor<4x8xf32>, %b: tensor<3xf32>) {
  // expected-error @+1 {{do not broadcast}}
  %0 = "dnn.add"(%a, %b) : (tensor<4x8xf32>, tensor<3xf32>) -> tensor<4x8xf32>
  return
}

// -----

func.func @gqa_groups(%q: tensor<1x6x16x4xf32>, %k: tensor<1x4x16x4xf32>) {
  // expected-error @+1 {{compound dimension (g r) at operand 0 dim 1 has length 6, which the known parts (4) do not divide}}
  %0 = "dnn.attention"(%q, %k, %k) : (tensor<1x6x16x4xf32>, tensor<1x4x16x4xf32>, tensor<1x4x16x4xf32>) -> tensor<1x6x16x4xf32>
  return
}

// -----

func.func @bad_slice(%a: tensor<4x8xf32>) {
  // expected-error @+1 {{slice [6, 9) is empty or outside dimension 1 of length 8}}
  %0 = "dnn.slice"(%a) {dim = 1 : i64, start = 6 : i64, end = 9 : i64} : (tensor<4x8xf32>) -> tensor<4x3xf32>
  return
}

// -----

func.func @two_errors_in_one_function(%a: tensor<4x8xf32>) {
  // expected-error @+1 {{'dnn.exp' result 0 has type tensor<8xf32>}}
  %0 = "dnn.exp"(%a) : (tensor<4x8xf32>) -> tensor<8xf32>
  // expected-error @+1 {{'dnn.nope' is not a dnn op}}
  %1 = "dnn.nope"(%a) : (tensor<4x8xf32>) -> tensor<8xf32>
  return
}

// -----

func.func @parse_error() {
  // expected-error @+1 {{expected operation name in quotes}}
  %0 =
}

// A user op is a function with nns.annotation; its problems are located on the function.
// RUN: nnscaler-opt --split-input-file --verify-diagnostics %s

// expected-error@below {{@gemm: 'nns.annotation' "m k, k n -> m n": identifier 'k' is reduced (it appears in no result) but is not marked '+' or '^'}}
func.func private @gemm(%a: tensor<8x16xf32>, %b: tensor<16x4xf32>) -> tensor<8x4xf32> attributes {nns.annotation = "m k, k n -> m n"} {
  %0 = "dnn.matmul"(%a, %b) : (tensor<8x16xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>
  return %0 : tensor<8x4xf32>
}

// -----

// expected-error@below {{@gemm: 'nns.annotation' "m k+, k+ n -> n m" gives result 0 the shape [4, 8] but the function returns tensor<8x4xf32>}}
func.func private @gemm(%a: tensor<8x16xf32>, %b: tensor<16x4xf32>) -> tensor<8x4xf32> attributes {nns.annotation = "m k+, k+ n -> n m"} {
  %0 = "dnn.matmul"(%a, %b) : (tensor<8x16xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>
  return %0 : tensor<8x4xf32>
}

// -----

// expected-error@below {{does not fit the arguments: dimension 'k' is 16 in operand 0 dim 1 but 8 in operand 1 dim 0}}
func.func private @gemm(%a: tensor<8x16xf32>, %b: tensor<8x4xf32>) -> tensor<8x4xf32> attributes {nns.annotation = "m k+, k+ n -> m n"} {
  %0 = "dnn.matmul"(%a, %a) {transpose_b = true} : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<8x8xf32>
  %1 = "dnn.matmul"(%0, %b) : (tensor<8x8xf32>, tensor<8x4xf32>) -> tensor<8x4xf32>
  return %1 : tensor<8x4xf32>
}

// -----

// expected-error@below {{@gemm: 'nns.vjp' names @gemm_vjp, which is not a function of this module}}
func.func private @gemm(%a: tensor<8x16xf32>, %b: tensor<16x4xf32>) -> tensor<8x4xf32> attributes {nns.annotation = "m k+, k+ n -> m n", nns.vjp = @gemm_vjp} {
  %0 = "dnn.matmul"(%a, %b) : (tensor<8x16xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>
  return %0 : tensor<8x4xf32>
}

// -----

// expected-error@below {{@kern: a user op without a body needs 'nns.kernel = "library:symbol"'}}
func.func private @kern(%a: tensor<4xf32>) -> tensor<4xf32> attributes {nns.annotation = "n -> n"}

// -----

// expected-error@below {{@f: unknown function attribute 'nns.anotation'}}
func.func @f(%a: tensor<4xf32>) -> tensor<4xf32> attributes {nns.anotation = "n -> n"} {
  %0 = "dnn.relu"(%a) : (tensor<4xf32>) -> tensor<4xf32>
  return %0 : tensor<4xf32>
}

// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<tp = 2>} : () -> ()
func.func private @lg(%x: tensor<8x16xf32>, %w: tensor<32x16xf32>) -> tensor<8x32xf32> attributes {nns.annotation = "m k^, n k^ -> m n"} {
  %y = "dnn.linear"(%x, %w) : (tensor<8x16xf32>, tensor<32x16xf32>) -> tensor<8x32xf32>
  return %y : tensor<8x32xf32>
}
func.func @train(%x: tensor<8x16xf32>, %w: tensor<32x16xf32>) -> tensor<8x32xf32> {
  // expected-error@below {{'func.call' nns.split: dimension 'k' is frozen ('k^' in 'm k^, n k^ -> m n') and cannot be split}}
  %r = func.call @lg(%x, %w) {nns.split = #nns.split<k = tp>} : (tensor<8x16xf32>, tensor<32x16xf32>) -> tensor<8x32xf32>
  return %r : tensor<8x32xf32>
}

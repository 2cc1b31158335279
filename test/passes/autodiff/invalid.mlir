// RUN: nnscaler-opt --autodiff --split-input-file --verify-diagnostics %s
// RUN: %not nnscaler-opt --autodiff="func=nope" %s 2>&1 | FileCheck %s --check-prefix=FUNC
// FUNC: autodiff: no function named @nope

// expected-error@+1 {{autodiff @f: the loss (result 0) must be a scalar float, not tensor<2xf32>}}
func.func @f(%w: tensor<2xf32> {nns.name = "w", nns.param}) -> (tensor<2xf32> {nns.name = "loss"}) {
  return %w : tensor<2xf32>
}

// -----

// expected-error@+1 {{autodiff @g: the function has no nns.param arguments to differentiate}}
func.func @g(%x: tensor<2xf32> {nns.name = "x"}) -> (tensor<f32> {nns.name = "loss"}) {
  %0 = "dnn.sum"(%x) {dims = array<i64: 0>} : (tensor<2xf32>) -> tensor<f32>
  return %0 : tensor<f32>
}

// -----

func.func @h(%x: tensor<2x3xf32> {nns.name = "x", nns.param}, %d: tensor<2x3xf32> {nns.name = "d"}) -> (tensor<f32> {nns.name = "loss"}) {
  // expected-error@+1 {{autodiff: 'dnn.relu_grad': is a backward op; second-order gradients are not supported}}
  %0 = "dnn.relu_grad"(%d, %x) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
  %1 = "dnn.sum"(%0) {dims = array<i64: 0, 1>} : (tensor<2x3xf32>) -> tensor<f32>
  return %1 : tensor<f32>
}

// -----

// expected-error@+1 {{autodiff @k: the function already returns gradients}}
func.func @k(%w: tensor<f32> {nns.name = "w", nns.param}) -> (tensor<f32> {nns.name = "loss"}, tensor<f32> {nns.name = "grad.w"}) {
  return %w, %w : tensor<f32>, tensor<f32>
}

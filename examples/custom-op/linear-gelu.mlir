// A user-defined operator: a fused "linear + gelu", defined as a function in dnn ops with
// its dimension annotation. `k` is frozen (`^`): gelu follows the sum over k, so k may not
// be split (a partial sum through gelu is not the gelu of the sum); m and n are spatial.
//
//   nnscaler-opt --autodiff --plan="dp-megatron dp=2 tp=2" --propagate-layouts \
//       --split-tensor --lower-relayouts --localize examples/custom-op/linear-gelu.mlir
//
// (see docs/extending.md).
func.func private @linear_gelu(%x: tensor<8x16xf32>, %w: tensor<32x16xf32>) -> tensor<8x32xf32>
    attributes {nns.annotation = "m k^, n k^ -> m n"} {
  %y = "dnn.linear"(%x, %w) : (tensor<8x16xf32>, tensor<32x16xf32>) -> tensor<8x32xf32>
  %z = "dnn.gelu"(%y) : (tensor<8x32xf32>) -> tensor<8x32xf32>
  return %z : tensor<8x32xf32>
}

// A two-layer MLP whose first layer is the user op.
func.func @train(%x: tensor<8x16xf32> {nns.name = "x"}, %labels: tensor<8xi64> {nns.name = "labels"},
                 %w1: tensor<32x16xf32> {nns.name = "fc1.weight", nns.param},
                 %w2: tensor<4x32xf32> {nns.name = "fc2.weight", nns.param})
    -> (tensor<f32> {nns.name = "loss"}) {
  %h = func.call @linear_gelu(%x, %w1) : (tensor<8x16xf32>, tensor<32x16xf32>) -> tensor<8x32xf32>
  %logits = "dnn.linear"(%h, %w2) : (tensor<8x32xf32>, tensor<4x32xf32>) -> tensor<8x4xf32>
  %loss = "dnn.cross_entropy"(%logits, %labels) : (tensor<8x4xf32>, tensor<8xi64>) -> tensor<f32>
  return %loss : tensor<f32>
}

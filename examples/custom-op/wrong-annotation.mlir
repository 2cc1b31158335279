// The fused "linear + gelu" of linear-gelu.mlir with a wrong annotation: k is marked summed
// (`+`), but gelu follows the sum over k, so a device holding part of k cannot compute its
// share of the result alone. `nnscaler check-op` finds it:
//
//   nnscaler check-op examples/custom-op/wrong-annotation.mlir @linear_gelu
//
// fails the k splits, naming the op of the body that would need communication (the gelu),
// and exits 1 (see docs/extending.md).
func.func private @linear_gelu(%x: tensor<8x16xf32>, %w: tensor<32x16xf32>) -> tensor<8x32xf32>
    attributes {nns.annotation = "m k+, n k+ -> m n"} {
  %y = "dnn.linear"(%x, %w) : (tensor<8x16xf32>, tensor<32x16xf32>) -> tensor<8x32xf32>
  %z = "dnn.gelu"(%y) : (tensor<8x32xf32>) -> tensor<8x32xf32>
  return %z : tensor<8x32xf32>
}

func.func @train(%x: tensor<8x16xf32> {nns.name = "x"}, %labels: tensor<8xi64> {nns.name = "labels"},
                 %w1: tensor<32x16xf32> {nns.name = "fc1.weight", nns.param},
                 %w2: tensor<4x32xf32> {nns.name = "fc2.weight", nns.param})
    -> (tensor<f32> {nns.name = "loss"}) {
  %h = func.call @linear_gelu(%x, %w1) : (tensor<8x16xf32>, tensor<32x16xf32>) -> tensor<8x32xf32>
  %logits = "dnn.linear"(%h, %w2) : (tensor<8x32xf32>, tensor<4x32xf32>) -> tensor<8x4xf32>
  %loss = "dnn.cross_entropy"(%logits, %labels) : (tensor<8x4xf32>, tensor<8xi64>) -> tensor<f32>
  return %loss : tensor<f32>
}

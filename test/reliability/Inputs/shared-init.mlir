// A parameter used both as a norm weight (ones) and as a linear bias (zeros).
func.func @train(%x: tensor<4x8xf32> {nns.name = "x"},
                 %w: tensor<8x8xf32> {nns.name = "w", nns.param},
                 %g: tensor<8xf32> {nns.name = "g", nns.param},
                 %b: tensor<8xf32> {nns.name = "b", nns.param})
    -> (tensor<f32> {nns.name = "loss"}) {
  %0 = "dnn.layer_norm"(%x, %g, %b) {eps = 1.0e-5 : f64} : (tensor<4x8xf32>, tensor<8xf32>, tensor<8xf32>) -> tensor<4x8xf32>
  %1 = "dnn.linear"(%0, %w, %g) : (tensor<4x8xf32>, tensor<8x8xf32>, tensor<8xf32>) -> tensor<4x8xf32>
  %2 = "dnn.mean"(%1) {dims = array<i64: 0, 1>} : (tensor<4x8xf32>) -> tensor<f32>
  return %2 : tensor<f32>
}

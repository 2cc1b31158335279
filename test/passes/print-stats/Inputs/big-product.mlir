func.func @train(%x: tensor<8192x4096xf32> {nns.name = "x"}, %w: tensor<4096x4096xf32> {nns.name = "w", nns.param}) -> (tensor<f32> {nns.name = "loss"}) {
  %y = "dnn.linear"(%x, %w) : (tensor<8192x4096xf32>, tensor<4096x4096xf32>) -> tensor<8192x4096xf32>
  %l = "dnn.mean"(%y) {dims = array<i64: 0, 1>} : (tensor<8192x4096xf32>) -> tensor<f32>
  return %l : tensor<f32>
}

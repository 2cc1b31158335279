func.func @f(%x: tensor<4x8xf32> {nns.name = "x"}, %w: tensor<3x8xf32> {nns.name = "w"}, %b: tensor<3xf32> {nns.name = "b"}) -> (tensor<4x3xf32> {nns.name = "y"}) {
  %y = "dnn.linear"(%x, %w, %b) : (tensor<4x8xf32>, tensor<3x8xf32>, tensor<3xf32>) -> tensor<4x3xf32>
  return %y : tensor<4x3xf32>
}

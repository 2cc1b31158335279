func.func @f(%dy: tensor<2xf32>, %x: tensor<2x3xf32>) -> tensor<2x3xf32> {
  %dx = "dnn.max_grad"(%dy, %x) {dims = array<i64: 1>} : (tensor<2xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
  return %dx : tensor<2x3xf32>
}

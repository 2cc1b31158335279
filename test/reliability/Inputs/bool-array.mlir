// MLIR 19 parses array<i1: 0, 1> but its printer segfaults on it.
func.func @h(%x: tensor<2x3xf32> {nns.name = "x"}) -> (tensor<f32> {nns.name = "r"}) {
  // line 3
  %1 = "dnn.sum"(%x) {dims = array<i1: 0, 1>} : (tensor<2x3xf32>) -> tensor<f32>
  return %1 : tensor<f32>
}

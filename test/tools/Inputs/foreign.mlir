func.func @f(%a: tensor<2x3xf32>, %b: tensor<2x3xf32>) -> tensor<2x3xf32> {
  %c = arith.addf %a, %b : tensor<2x3xf32>
  return %c : tensor<2x3xf32>
}

// Five ops with a wrong result type.
func.func @f(%a: tensor<4x8xf32>) {
  // line 3
  %0 = "dnn.relu"(%a) : (tensor<4x8xf32>) -> tensor<4x9xf32>
  %1 = "dnn.relu"(%a) : (tensor<4x8xf32>) -> tensor<4x9xf32>
  %2 = "dnn.relu"(%a) : (tensor<4x8xf32>) -> tensor<4x9xf32>
  %3 = "dnn.relu"(%a) : (tensor<4x8xf32>) -> tensor<4x9xf32>
  %4 = "dnn.relu"(%a) : (tensor<4x8xf32>) -> tensor<4x9xf32>
  return
}

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 2>} : () -> ()
func.func @f(%a: tensor<4x6x2xf32> {nns.layout = #nns.layout<@world, dp = D(0), tp = D(1)>},
             %b: tensor<6x4xf32> {nns.layout = #nns.layout<@world, tp = D(1)>})
    -> (tensor<4x6x2xf32> {nns.layout = #nns.layout<@world, dp = D(0), tp = D(2)>}, tensor<6x4xf32> {nns.layout = #nns.layout<@world, tp = D(0)>}, tensor<6x4xf32> {nns.layout = #nns.layout<@world, tp = D(1)>}) {
  %0 = "nns.relayout"(%a) {to = #nns.layout<@world, dp = D(0), tp = D(2)>} : (tensor<4x6x2xf32>) -> tensor<4x6x2xf32>
  %1 = "dnn.exp"(%0) : (tensor<4x6x2xf32>) -> tensor<4x6x2xf32>
  %2 = "nns.relayout"(%b) {to = #nns.layout<@world, tp = D(0)>} : (tensor<6x4xf32>) -> tensor<6x4xf32>
  %3 = "dnn.mul"(%2, %2) : (tensor<6x4xf32>, tensor<6x4xf32>) -> tensor<6x4xf32>
  %4 = "nns.relayout"(%3) {to = #nns.layout<@world, tp = D(1)>} : (tensor<6x4xf32>) -> tensor<6x4xf32>
  return %1, %3, %4 : tensor<4x6x2xf32>, tensor<6x4xf32>, tensor<6x4xf32>
}

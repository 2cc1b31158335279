"nns.mesh"() {sym_name = "world", axes = #nns.axes<tp = 2>} : () -> ()
func.func @f(%x: tensor<4x4xf32> {nns.layout = #nns.layout<@world, tp = D(0)>}) -> (tensor<4x4xf32> {nns.layout = #nns.layout<@world>}) {
  %0 = "nns.relayout"(%x) {to = #nns.layout<@world>} : (tensor<4x4xf32>) -> tensor<4x4xf32>
  return %0 : tensor<4x4xf32>
}

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 2>} : () -> ()
func.func @f(%x: tensor<4x2xf32> {nns.layout = #nns.layout<@world, tp = D(1)>, nns.name = "x"})
    -> (tensor<4x2xf32> {nns.layout = #nns.layout<@world>, nns.name = "y"}) attributes {nns.localized = #nns.axes<dp = 2, tp = 2>} {
  %0 = "nns.broadcast"(%x) {axes = ["tp"], root = 1 : i64, nns.layouts = [#nns.layout<@world>]} : (tensor<4x2xf32>) -> tensor<4x2xf32>
  return %0 : tensor<4x2xf32>
}

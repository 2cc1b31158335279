"nns.mesh"() {sym_name = "world", axes = #nns.axes<tp = 2>} : () -> ()
func.func @f(%x: tensor<8x6xf32>) -> tensor<8x6xf32> {
  %e = "dnn.exp"(%x) : (tensor<8x6xf32>) -> tensor<8x6xf32>
  %n = "dnn.neg"(%e) {nns.split = #nns.split<R(sp)>} : (tensor<8x6xf32>) -> tensor<8x6xf32>
  return %n : tensor<8x6xf32>
}

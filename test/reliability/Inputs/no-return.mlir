// A function whose body does not end with a return (found by the fuzzer: it crashed --split-tensor).
"nns.mesh"() {sym_name = "world", axes = #nns.axes<tp = 2>} : () -> ()
func.func @f(%a: tensor<8x16xf32> {nns.name = "a"}, %b: tensor<16x4xf32> {nns.name = "b"}) -> (tensor<8x4xf32> {nns.name = "r"}) {
  %0 = "dnn.matmul"(%a, %b) {nns.pin = #nns.split<m = tp>} : (tensor<8x16xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>
}
// Reshapes: an intermediate one takes its operand's buffer (no copy); results keep their own
// buffers (their ports' shapes). test/tools/compile.test runs it.
func.func @f(%x: tensor<4x6xf32> {nns.name = "x"}) -> (tensor<24xf32> {nns.name = "flat"}, tensor<6x4xf32> {nns.name = "y"}, tensor<4x6xf32> {nns.name = "z"}) {
  %a = "dnn.reshape"(%x) {shape = array<i64: 24>} : (tensor<4x6xf32>) -> tensor<24xf32>
  %b = "dnn.reshape"(%a) {shape = array<i64: 6, 4>} : (tensor<24xf32>) -> tensor<6x4xf32>
  %c = "dnn.exp"(%b) : (tensor<6x4xf32>) -> tensor<6x4xf32>
  %d = "dnn.reshape"(%c) {shape = array<i64: 4, 6>} : (tensor<6x4xf32>) -> tensor<4x6xf32>
  return %a, %c, %d : tensor<24xf32>, tensor<6x4xf32>, tensor<4x6xf32>
}

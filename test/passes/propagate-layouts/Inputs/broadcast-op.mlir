// User ops whose bodies broadcast into new leading dims (`n=8`: a dim in no operand).
// Splitting `n` splits the result alone; each device repeats its operand into its piece.
func.func @tile(%x: tensor<4x6xf32>) -> tensor<8x4x6xf32> attributes {nns.annotation = "a b -> n=8 a b"} {
  %b = "dnn.broadcast_to"(%x) {shape = array<i64: 8, 4, 6>} : (tensor<4x6xf32>) -> tensor<8x4x6xf32>
  %e = "dnn.exp"(%b) : (tensor<8x4x6xf32>) -> tensor<8x4x6xf32>
  return %e : tensor<8x4x6xf32>
}
// A scale per row broadcast over the batch of `y`, and over its own size-1 dim.
func.func @scale(%s: tensor<4x1xf32>, %y: tensor<8x4x6xf32>) -> tensor<8x4x6xf32> attributes {nns.annotation = "a 1, n a b -> n a b"} {
  %b = "dnn.broadcast_to"(%s) {shape = array<i64: 8, 4, 6>} : (tensor<4x1xf32>) -> tensor<8x4x6xf32>
  %m = "dnn.mul"(%b, %y) : (tensor<8x4x6xf32>, tensor<8x4x6xf32>) -> tensor<8x4x6xf32>
  return %m : tensor<8x4x6xf32>
}

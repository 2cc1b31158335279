// User ops whose bodies are shape ops: every split their annotations allow is computed
// without communication (nnscaler check-op runs each over 2 and 4 devices).
func.func @swap(%x: tensor<8x4x6xf32>) -> tensor<6x8x4xf32> attributes {nns.annotation = "a b c -> c a b"} {
  %t = "dnn.transpose"(%x) {perm = array<i64: 2, 0, 1>} : (tensor<8x4x6xf32>) -> tensor<6x8x4xf32>
  return %t : tensor<6x8x4xf32>
}
// Rotate the columns by 2: split then concat the other way round (b whole).
func.func @rotate(%x: tensor<8x6xf32>) -> tensor<8x6xf32> attributes {nns.annotation = "a b^ -> a b^"} {
  %p:2 = "dnn.split"(%x) {dim = 1 : i64, sizes = array<i64: 2, 4>} : (tensor<8x6xf32>) -> (tensor<8x2xf32>, tensor<8x4xf32>)
  %c = "dnn.concat"(%p#1, %p#0) {dim = 1 : i64} : (tensor<8x4xf32>, tensor<8x2xf32>) -> tensor<8x6xf32>
  return %c : tensor<8x6xf32>
}
// Merge the two leading dims (a view).
func.func @merge(%x: tensor<4x2x6xf32>) -> tensor<8x6xf32> attributes {nns.annotation = "a b c -> (a b) c"} {
  %r = "dnn.reshape"(%x) {shape = array<i64: 8, 6>} : (tensor<4x2x6xf32>) -> tensor<8x6xf32>
  return %r : tensor<8x6xf32>
}

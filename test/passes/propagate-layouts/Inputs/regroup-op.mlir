// A user op whose body regroups factors: (b n) c -> b (n c), then doubles.
func.func @regroup(%x: tensor<8x6xf32>) -> tensor<4x12xf32> attributes {nns.annotation = "(b 2) c -> b (2 c)"} {
  %r = "dnn.reshape"(%x) {shape = array<i64: 4, 12>} : (tensor<8x6xf32>) -> tensor<4x12xf32>
  %y = "dnn.add"(%r, %r) : (tensor<4x12xf32>, tensor<4x12xf32>) -> tensor<4x12xf32>
  return %y : tensor<4x12xf32>
}

// A parameter of 2^40 elements (4 TiB): valid IR, but no machine here can hold it.
func.func @train(%x: tensor<4xf32> {nns.name = "x"}, %w: tensor<1099511627776xf32> {nns.name = "w", nns.param}) -> (tensor<f32> {nns.name = "loss"}) {
  %0 = "dnn.sum"(%w) {dims = array<i64: 0>} : (tensor<1099511627776xf32>) -> tensor<f32>
  return %0 : tensor<f32>
}

// A user op with a new leading dim (`n=8`, in no argument), split over dp by its call:
// each device makes its piece of the broadcast; the gradient sums over n (all_reduce).
"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2>} : () -> ()
func.func private @tile(%x: tensor<4x6xf32>) -> tensor<8x4x6xf32> attributes {nns.annotation = "a b -> n=8 a b"} {
  %b = "dnn.broadcast_to"(%x) {shape = array<i64: 8, 4, 6>} : (tensor<4x6xf32>) -> tensor<8x4x6xf32>
  %e = "dnn.exp"(%b) : (tensor<8x4x6xf32>) -> tensor<8x4x6xf32>
  return %e : tensor<8x4x6xf32>
}
func.func @train(%y: tensor<8x4x6xf32> {nns.name = "y"}, %w: tensor<4x6xf32> {nns.name = "w", nns.param}) -> (tensor<f32> {nns.name = "loss"}) {
  %t = func.call @tile(%w) {nns.split = #nns.split<n = dp>} : (tensor<4x6xf32>) -> tensor<8x4x6xf32>
  %m = "dnn.mul"(%t, %y) : (tensor<8x4x6xf32>, tensor<8x4x6xf32>) -> tensor<8x4x6xf32>
  %l = "dnn.mean"(%m) {dims = array<i64: 0, 1, 2>} : (tensor<8x4x6xf32>) -> tensor<f32>
  return %l : tensor<f32>
}

// A mesh whose memory cap holds only if fc runs split over tp, and a directive that
// replicates fc over tp (R(tp)); proj's R(tp) takes no part in the conflict.
"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 1, tp = 2>, memory_cap = 30000 : i64} : () -> ()
func.func @train(%x: tensor<4x8x16xf32> {nns.name = "x"}, %y: tensor<32xi64> {nns.name = "labels"},
                 %fw: tensor<64x16xf32> {nns.name = "fc.weight", nns.param}, %fb: tensor<64xf32> {nns.name = "fc.bias", nns.param},
                 %pw: tensor<16x64xf32> {nns.name = "proj.weight", nns.param}, %pb: tensor<16xf32> {nns.name = "proj.bias", nns.param})
    -> (tensor<f32> {nns.name = "loss"}) {
  %f = "dnn.linear"(%x, %fw, %fb) {nns.split = #nns.split<R(tp)>} : (tensor<4x8x16xf32>, tensor<64x16xf32>, tensor<64xf32>) -> tensor<4x8x64xf32>
  %g = "dnn.gelu"(%f) : (tensor<4x8x64xf32>) -> tensor<4x8x64xf32>
  %p = "dnn.linear"(%g, %pw, %pb) {nns.split = #nns.split<R(tp)>} : (tensor<4x8x64xf32>, tensor<16x64xf32>, tensor<16xf32>) -> tensor<4x8x16xf32>
  %l = "dnn.reshape"(%p) {shape = array<i64: 32, 16>} : (tensor<4x8x16xf32>) -> tensor<32x16xf32>
  %c = "dnn.cross_entropy"(%l, %y) : (tensor<32x16xf32>, tensor<32xi64>) -> tensor<f32>
  return %c : tensor<f32>
}

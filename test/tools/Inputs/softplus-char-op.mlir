// softplus(x) = log(1 + exp(x)), elementwise: a user op (annotation and body) that
// `nnscaler import torch --user-ops` calls for `aten::softplus(x, 1, 20)` (beta 1,
// threshold 20: the defaults of F.softplus), at the shape of test/tools/import-torch.test's training batch.
func.func @softplus(%x: tensor<4x8x32xf32>) -> tensor<4x8x32xf32>
    attributes {nns.annotation = "* -> *", nns.torch = "aten::softplus(x, 1, 20)"} {
  %e = "dnn.exp"(%x) : (tensor<4x8x32xf32>) -> tensor<4x8x32xf32>
  %one = "dnn.fill"() {shape = array<i64>, value = 1.0 : f64} : () -> tensor<f32>
  %a = "dnn.add"(%e, %one) : (tensor<4x8x32xf32>, tensor<f32>) -> tensor<4x8x32xf32>
  %y = "dnn.log"(%a) : (tensor<4x8x32xf32>) -> tensor<4x8x32xf32>
  return %y : tensor<4x8x32xf32>
}

// The user op of linear-gelu.mlir implemented in C (linear_gelu.c, nnscaler's kernel ABI):
// a declaration with its annotation, the kernel, and the VJP, itself a kernel op with the
// annotation Annotation::vjp derives. Build the library, then run from its directory:
//
//   cc -shared -fPIC -O2 -I runtime/include -o liblinear_gelu.so examples/custom-op/linear_gelu.c -lm
//   nnscaler check-op examples/custom-op/linear-gelu-kernel.mlir @linear_gelu
func.func private @linear_gelu(%x: tensor<8x16xf32>, %w: tensor<32x16xf32>) -> tensor<8x32xf32>
    attributes {nns.annotation = "m k^, n k^ -> m n", nns.kernel = "./liblinear_gelu.so:linear_gelu",
                nns.vjp = @linear_gelu_vjp}
func.func private @linear_gelu_vjp(%x: tensor<8x16xf32>, %w: tensor<32x16xf32>, %dz: tensor<8x32xf32>)
    -> (tensor<8x16xf32>, tensor<32x16xf32>)
    attributes {nns.annotation = "m+ k^, n+ k^, m+ n+ -> m k, n k",
                nns.kernel = "./liblinear_gelu.so:linear_gelu_vjp"}

func.func @train(%x: tensor<8x16xf32> {nns.name = "x"}, %labels: tensor<8xi64> {nns.name = "labels"},
                 %w1: tensor<32x16xf32> {nns.name = "fc1.weight", nns.param},
                 %w2: tensor<4x32xf32> {nns.name = "fc2.weight", nns.param})
    -> (tensor<f32> {nns.name = "loss"}) {
  %h = func.call @linear_gelu(%x, %w1) : (tensor<8x16xf32>, tensor<32x16xf32>) -> tensor<8x32xf32>
  %logits = "dnn.linear"(%h, %w2) : (tensor<8x32xf32>, tensor<4x32xf32>) -> tensor<8x4xf32>
  %loss = "dnn.cross_entropy"(%logits, %labels) : (tensor<8x4xf32>, tensor<8xi64>) -> tensor<f32>
  return %loss : tensor<f32>
}

// A model written by hand in the dnn dialect: a character-level bigram language model
// (each position predicts the next character from its own, through a 64-wide embedding).
//
// The conventions the tools rely on:
//   - the function to train or run is @train (or the only function);
//   - every argument and result has a name (nns.name): tensor files bind by it;
//   - trained weights are marked nns.param (drawn by nnscaler run --init-seed, normal(0,
//     0.02) unless nns.init says otherwise, or read from --params); the rest are inputs;
//   - nnscaler train feeds `tokens` and `targets` ([batch, positions] ids) and minimizes
//     the scalar result named `loss`.
//
//   nnscaler data random examples/own-model/bigram.mlir -o bigram-batch.safetensors
//   nnscaler run examples/own-model/bigram.mlir --autodiff --inputs bigram-batch.safetensors --init-seed 0 -o bigram-out.safetensors
//   nnscaler train --config examples/own-model/bigram.toml
func.func @train(%tokens: tensor<16x32xi64> {nns.name = "tokens"},
                 %targets: tensor<16x32xi64> {nns.name = "targets"},
                 %wte: tensor<65x64xf32> {nns.name = "wte", nns.param},
                 %head: tensor<65x64xf32> {nns.name = "head.weight", nns.param},
                 %bias: tensor<65xf32> {nns.name = "head.bias", nns.param, nns.init = "zeros"})
    -> (tensor<f32> {nns.name = "loss"}) {
  %x = "dnn.embedding"(%tokens, %wte) : (tensor<16x32xi64>, tensor<65x64xf32>) -> tensor<16x32x64xf32>
  %h = "dnn.gelu"(%x) : (tensor<16x32x64xf32>) -> tensor<16x32x64xf32>
  %logits = "dnn.linear"(%h, %head, %bias) : (tensor<16x32x64xf32>, tensor<65x64xf32>, tensor<65xf32>) -> tensor<16x32x65xf32>
  %loss = "dnn.cross_entropy"(%logits, %targets) : (tensor<16x32x65xf32>, tensor<16x32xi64>) -> tensor<f32>
  return %loss : tensor<f32>
}

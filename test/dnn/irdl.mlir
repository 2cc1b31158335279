// The dnn and nns dialects as IRDL (dialects/irdl/, generated from the op tables) let
// upstream mlir-opt-19 check op names, operand and result counts and required attributes
// without --allow-unregistered-dialect.
//
// The committed files are what the tables generate:
// RUN: nnscaler-opt --print-irdl=all | diff - %S/../../dialects/irdl/nnscaler.irdl.mlir
// RUN: nnscaler-opt --print-irdl=dnn | diff - %S/../../dialects/irdl/dnn.irdl.mlir
//
// Whole models, before and after autodiff, are accepted:
// RUN: nnscaler import --preset gpt-tiny -o %t.gpt.mlir
// RUN: nnscaler-opt --autodiff %t.gpt.mlir -o %t.gpt.ad.mlir
// RUN: mlir-opt --irdl-file=%S/../../dialects/irdl/nnscaler.irdl.mlir %t.gpt.ad.mlir -o /dev/null
// RUN: nnscaler import --preset llama-tiny -o %t.llama.mlir
// RUN: nnscaler-opt --autodiff %t.llama.mlir -o %t.llama.ad.mlir
// RUN: mlir-opt --irdl-file=%S/../../dialects/irdl/nnscaler.irdl.mlir %t.llama.ad.mlir -o /dev/null
//
// Partitioned IR carries #nns attributes, whose custom syntax IRDL cannot describe: the dnn
// file checks the dnn ops and nns stays unregistered.
// RUN: nnscaler-opt --autodiff --plan="dp-megatron dp=2 tp=2" --propagate-layouts --split-tensor --lower-relayouts --localize %t.gpt.mlir -o %t.gpt.local.mlir
// RUN: mlir-opt --allow-unregistered-dialect --irdl-file=%S/../../dialects/irdl/dnn.irdl.mlir %t.gpt.local.mlir -o /dev/null
//
// Wrong ops are errors:
// RUN: mlir-opt --irdl-file=%S/../../dialects/irdl/nnscaler.irdl.mlir --split-input-file --verify-diagnostics %s

func.func @unknown(%a: tensor<2x2xf32>) {
  // expected-error@below {{unregistered operation 'dnn.matmal' found in dialect ('dnn') that does not allow unknown operations}}
  %0 = "dnn.matmal"(%a, %a) : (tensor<2x2xf32>, tensor<2x2xf32>) -> tensor<2x2xf32>
  return
}

// -----

func.func @operands(%a: tensor<2x2xf32>) {
  // expected-error@below {{expects exactly 2 operands, but got 1}}
  %0 = "dnn.matmul"(%a) : (tensor<2x2xf32>) -> tensor<2x2xf32>
  return
}

// -----

func.func @results(%a: tensor<2x2xf32>) {
  // expected-error@below {{expects exactly 1 results, but got 2}}
  %0:2 = "dnn.relu"(%a) : (tensor<2x2xf32>) -> (tensor<2x2xf32>, tensor<2x2xf32>)
  return
}

// -----

func.func @required_attribute(%a: tensor<2x2xf32>) {
  // expected-error@below {{attribute "dims" is expected but not provided}}
  %0 = "dnn.mean"(%a) : (tensor<2x2xf32>) -> tensor<f32>
  return
}

// -----

func.func @attribute_kind(%a: tensor<2x2xf32>) {
  // expected-error@below {{'"x"' does not satisfy the constraint}}
  %0 = "dnn.mean"(%a) {dims = "x"} : (tensor<2x2xf32>) -> tensor<f32>
  return
}

// -----

func.func @operand_kind(%a: memref<2x2xf32>) {
  // expected-error@below {{expected base type 'builtin.tensor' but got 'builtin.memref'}}
  %0 = "dnn.relu"(%a) : (memref<2x2xf32>) -> tensor<2x2xf32>
  return
}

// -----

func.func @collective(%a: tensor<2x2xf32>) {
  // expected-error@below {{attribute "dim" is expected but not provided}}
  %0 = "nns.all_gather"(%a) {axes = ["tp"]} : (tensor<2x2xf32>) -> tensor<4x2xf32>
  return
}

// -----

// A limit of MLIR 19's IRDL: a constraint variable binds the first type it matches, and a
// variadic group shares one variable, so pieces of different shapes (valid dnn.concat /
// dnn.split) are refused. nnscaler's own verifier accepts them.
func.func @variadic(%a: tensor<2x3xf32>, %b: tensor<2x1xf32>) {
  // expected-error@below {{expected 'tensor<2x3xf32>' but got 'tensor<2x1xf32>'}}
  %0 = "dnn.concat"(%a, %b) {dim = 1 : i64} : (tensor<2x3xf32>, tensor<2x1xf32>) -> tensor<2x4xf32>
  return
}

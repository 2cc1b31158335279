// Pins (nns.stage) and bounds (nns.stage_bounds) written by the user are kept; ones that
// cannot hold are errors at the op.
// RUN: nnscaler-opt --split-input-file --verify-diagnostics --place="stages=2" %s


func.func @g(%x: tensor<8x32xf32>) -> tensor<8x32xf32> {
  %a = "dnn.relu"(%x) {nns.stage = 1} : (tensor<8x32xf32>) -> tensor<8x32xf32>
  // expected-error@below {{place: 'dnn.relu': must be on a stage <= 0, but an earlier op is on stage 1 or later (stages are contiguous in program order)}}
  %b = "dnn.relu"(%a) {nns.stage = 0} : (tensor<8x32xf32>) -> tensor<8x32xf32>
  return %b : tensor<8x32xf32>
}

// -----

// expected-error@below {{place: @h has 1 ops, fewer than the 2 stages (every stage needs one)}}
func.func @h(%x: tensor<8x32xf32>) -> tensor<8x32xf32> {
  %a = "dnn.relu"(%x) : (tensor<8x32xf32>) -> tensor<8x32xf32>
  return %a : tensor<8x32xf32>
}

// -----

func.func @k(%x: tensor<8x32xf32>) -> tensor<8x32xf32> {
  // expected-error@below {{place: 'dnn.relu': is pinned to stage 5, but there are 2 stages}}
  %a = "dnn.relu"(%x) {nns.stage = 5} : (tensor<8x32xf32>) -> tensor<8x32xf32>
  %b = "dnn.relu"(%a) : (tensor<8x32xf32>) -> tensor<8x32xf32>
  return %b : tensor<8x32xf32>
}

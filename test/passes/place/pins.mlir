// Pins (nns.stage) and bounds (nns.stage_bounds) written by the user are kept; ones that
// cannot hold are errors at the op.
// RUN: nnscaler-opt --split-input-file --verify-diagnostics --place="stages=2" %s


// Z3's unsat core names the constraints that cannot hold together: here the first op's
// pin alone (the first op is on stage 0)...
func.func @g(%x: tensor<8x32xf32>) -> tensor<8x32xf32> {
  // expected-error@below {{place: no placement of @g in 2 stages satisfies these together: 'dnn.relu' (line 10) on stage 1 (stages are contiguous in program order, each non-empty, the first op on stage 0)}}
  %a = "dnn.relu"(%x) {nns.stage = 1} : (tensor<8x32xf32>) -> tensor<8x32xf32>
  %b = "dnn.relu"(%a) {nns.stage = 0} : (tensor<8x32xf32>) -> tensor<8x32xf32>
  return %b : tensor<8x32xf32>
}

// -----

// ... and here two pins that hold alone but not together (a later op on an earlier
// stage); the other one is a note.
func.func @g2(%x: tensor<8x32xf32>) -> tensor<8x32xf32> {
  %a = "dnn.relu"(%x) : (tensor<8x32xf32>) -> tensor<8x32xf32>
  // expected-error@below {{place: no placement of @g2 in 2 stages satisfies these together: 'dnn.relu' (line 22) on stage 1; 'dnn.relu' (line 24) on stage 0}}
  %b = "dnn.relu"(%a) {nns.stage = 1} : (tensor<8x32xf32>) -> tensor<8x32xf32>
  // expected-note@below {{a conflicting constraint is here}}
  %c = "dnn.relu"(%b) {nns.stage = 0} : (tensor<8x32xf32>) -> tensor<8x32xf32>
  %d = "dnn.relu"(%c) : (tensor<8x32xf32>) -> tensor<8x32xf32>
  return %d : tensor<8x32xf32>
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

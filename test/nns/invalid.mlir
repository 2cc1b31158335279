// Every nns verifier error, located.
// RUN: nnscaler-opt --split-input-file --verify-diagnostics %s

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
func.func @frozen(%a: tensor<6x8xf32>) {
  // expected-error @+1 {{dimension 'b' is frozen ('b^' in 'a b^ -> a b') and cannot be split}}
  %0 = "dnn.softmax"(%a) {nns.split = #nns.split<b = tp>} : (tensor<6x8xf32>) -> tensor<6x8xf32>
  return
}

// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
func.func @not_dividing(%a: tensor<6x8xf32>, %b: tensor<8x16xf32>) {
  // expected-error @+1 {{dimension 'm' (result 0 dim 0) has length 6, which tp (size 4) does not divide}}
  %0 = "dnn.matmul"(%a, %b) {nns.split = #nns.split<m = tp>} : (tensor<6x8xf32>, tensor<8x16xf32>) -> tensor<6x16xf32>
  return
}

// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
func.func @unknown_axis(%a: tensor<8x8xf32>, %b: tensor<8x16xf32>) {
  // expected-error @+1 {{mesh '@world' has no axis 'pp'}}
  %0 = "dnn.matmul"(%a, %b) {nns.split = #nns.split<k = pp>} : (tensor<8x8xf32>, tensor<8x16xf32>) -> tensor<8x16xf32>
  return
}

// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
func.func @two_directives(%a: tensor<8x8xf32>, %b: tensor<8x16xf32>) {
  // expected-error @+1 {{identifier 'k' has two split directives}}
  %0 = "dnn.matmul"(%a, %b) {nns.split = #nns.split<k = dp, k = tp>} : (tensor<8x8xf32>, tensor<8x16xf32>) -> tensor<8x16xf32>
  return
}

// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
func.func @axis_twice(%a: tensor<8x8xf32>, %b: tensor<8x16xf32>) {
  // expected-error @+1 {{mesh axis 'tp' splits both 'm' and 'k'}}
  %0 = "dnn.matmul"(%a, %b) {nns.split = #nns.split<m = tp, k = tp>} : (tensor<8x8xf32>, tensor<8x16xf32>) -> tensor<8x16xf32>
  return
}

// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
func.func @unknown_id(%a: tensor<8x8xf32>, %b: tensor<8x16xf32>) {
  // expected-error @+1 {{the op has no dimension 'z'}}
  %0 = "dnn.matmul"(%a, %b) {nns.split = #nns.split<z = tp>} : (tensor<8x8xf32>, tensor<8x16xf32>) -> tensor<8x16xf32>
  return
}

// -----

func.func @no_mesh(%a: tensor<8x8xf32>) {
  // expected-error @+1 {{the module declares no 'nns.mesh'}}
  %0 = "dnn.relu"(%a) {nns.split = #nns.split<*0 = tp>} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  return
}

// -----

// expected-error @+1 {{axis 'dp' has size '0'; sizes are positive integers}}
"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 0>} : () -> ()

// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
// expected-error @+1 {{@f argument 0: layout <@world, pp = D(0)> does not fit the value: mesh '@world' has no axis 'pp'}}
func.func @f(%a: tensor<8x8xf32> {nns.layout = #nns.layout<@world, pp = D(0)>}) {
  return
}

// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
// expected-error @+1 {{axis 'tp' splits dim 2 but the tensor has rank 2}}
func.func @g(%a: tensor<8x8xf32> {nns.layout = #nns.layout<@world, tp = D(2)>}) {
  return
}

// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
// expected-error @+1 {{dim 0 of length 6 cannot be split 4 ways}}
func.func @h(%a: tensor<6x8xf32> {nns.layout = #nns.layout<@world, tp = D(0)>}) {
  return
}

// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
func.func @collective_axis(%a: tensor<8x8xf32>) {
  // expected-error @+1 {{'nns.all_reduce' mesh '@world' has no axis 'pp'}}
  %0 = "nns.all_reduce"(%a) {axes = ["pp"]} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  return
}

// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
func.func @gather_divides(%a: tensor<6x8xf32>) {
  // expected-error @+1 {{dim 0 of length 6 cannot be split 4 ways over tp}}
  %0 = "nns.all_gather"(%a) {axes = ["tp"], dim = 0 : i64} : (tensor<6x8xf32>) -> tensor<6x8xf32>
  return
}

// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
func.func @global_shapes(%a: tensor<8x8xf32>) {
  // expected-error @+1 {{collectives keep global shapes until --localize}}
  %0 = "nns.all_gather"(%a) {axes = ["tp"], dim = 0 : i64} : (tensor<8x8xf32>) -> tensor<32x8xf32>
  return
}

// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
func.func @broadcast_root(%a: tensor<8x8xf32>) {
  // A root beyond the group (4 devices over tp), and no root at all: every consumer of
  // the op (the simulated devices, codegen, emit-torch) reads it, so the verifier asks.
  // expected-error @+1 {{requires 'root', the member whose value is copied, in 0..4}}
  %0 = "nns.broadcast"(%a) {axes = ["tp"], root = 4 : i64} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  // expected-error @+1 {{requires 'root', the member whose value is copied, in 0..2}}
  %1 = "nns.broadcast"(%a) {axes = ["dp"]} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  return
}

// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
func.func @bad_reduce(%a: tensor<8x8xf32>) {
  // expected-error @+1 {{'reduce' must be "sum" or "max"}}
  %0 = "nns.all_reduce"(%a) {axes = ["tp"], reduce = "avg"} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  return
}

// -----

func.func @unknown_nns_op(%a: tensor<8x8xf32>) {
  // expected-error @+1 {{'nns.teleport' is not an nns op}}
  %0 = "nns.teleport"(%a) : (tensor<8x8xf32>) -> tensor<8x8xf32>
  return
}

// -----

func.func @unknown_nns_attr(%a: tensor<8x8xf32>) {
  // expected-error @+1 {{unknown attribute 'nns.bogus'}}
  %0 = "dnn.relu"(%a) {nns.bogus = 1 : i64} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  return
}

// -----

func.func @negative_stage(%a: tensor<8x8xf32>) {
  // expected-error @+1 {{'nns.stage' must be an integer >= 0}}
  %0 = "dnn.relu"(%a) {nns.stage = -1 : i64} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  return
}

// -----

// expected-error @+1 {{@dup argument 1: name "x" is used twice}}
func.func @dup(%a: tensor<8xf32> {nns.name = "x"}, %b: tensor<8xf32> {nns.name = "x"}) {
  return
}

// -----

func.func @stage_bounds(%a: tensor<8x8xf32>) {
  // expected-error @+1 {{'nns.stage_bounds' must be array<i64: lo, hi> with 0 <= lo <= hi, got [3, 1]}}
  %0 = "dnn.relu"(%a) {nns.stage_bounds = array<i64: 3, 1>} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  // expected-error @+1 {{'nns.stage' 5 is outside its 'nns.stage_bounds' [0, 2]}}
  %1 = "dnn.relu"(%0) {nns.stage = 5 : i64, nns.stage_bounds = array<i64: 0, 2>} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  return
}

// -----

// expected-error @+2 {{'nns.mesh' @capped: 'memory_cap' must be a positive integer (bytes per device)}}
// expected-error @+1 {{'nns.mesh' @capped: unknown attribute 'speed'}}
"nns.mesh"() {sym_name = "capped", axes = #nns.axes<dp = 2>, memory_cap = 0 : i64, speed = 3 : i64} : () -> ()

// RUN: %not nnscaler-opt --split-input-file %s 2>&1 | FileCheck %s
// Localized programs are verified against their local shapes and their mesh: what the
// verifier accepts, `nnscaler run` executes without panicking.

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 5, tp = 2>} : () -> ()
// CHECK: localized.mlir:[[@LINE+1]]:1: error: @f: was localized for a mesh <dp = 2, tp = 2>, but mesh '@world' is <dp = 5, tp = 2>; localize the global program again for this mesh
func.func @f(%a: tensor<2x4xf32> {nns.name = "a", nns.layout = #nns.layout<@world, dp = D(0)>}) -> (tensor<2x4xf32> {nns.name = "r"}) attributes {nns.localized = #nns.axes<dp = 2, tp = 2>} {
  return %a : tensor<2x4xf32>
}

// -----
"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2>} : () -> ()
// CHECK: localized.mlir:[[@LINE+1]]:1: error: @f: 'nns.localized' must record the mesh
func.func @f(%a: tensor<2x4xf32> {nns.name = "a"}) -> (tensor<2x4xf32> {nns.name = "r"}) attributes {nns.localized} {
  return %a : tensor<2x4xf32>
}

// -----
"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2>} : () -> ()
// CHECK: localized.mlir:[[@LINE+1]]:1: error: @f result 1: name "r" is used twice
func.func @f(%a: tensor<2x4xf32> {nns.name = "a"}) -> (tensor<2x4xf32> {nns.name = "r"}, tensor<2x4xf32> {nns.name = "r"}) attributes {nns.localized = #nns.axes<dp = 2>} {
  return %a, %a : tensor<2x4xf32>, tensor<2x4xf32>
}

// -----
"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2>} : () -> ()
func.func @f(%a: tensor<2x4xf32> {nns.name = "a"}) -> (tensor<2x4xf32> {nns.name = "r"}) attributes {nns.localized = #nns.axes<dp = 2>} {
  // CHECK: localized.mlir:[[@LINE+1]]:8: error: 'nns.all_reduce' takes one operand and one result, has 0 and 1
  %0 = "nns.all_reduce"() {axes = ["dp"]} : () -> tensor<2x4xf32>
  // CHECK: localized.mlir:[[@LINE+1]]:8: error: 'nns.partition' takes one operand and one result, has 0 and 1
  %1 = "nns.partition"() {axes = ["dp"]} : () -> tensor<2x4xf32>
  return %a : tensor<2x4xf32>
}

// -----
"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
func.func @f(%a: tensor<2x4xf32> {nns.name = "a"}) -> (tensor<2x4xf32> {nns.name = "r"}) attributes {nns.localized = #nns.axes<dp = 2, tp = 4>} {
  // Local shapes follow the collective: gather multiplies, scatter and slice divide.
  %0 = "nns.all_gather"(%a) {axes = ["tp"], dim = 1 : i64} : (tensor<2x4xf32>) -> tensor<2x16xf32>
  %1 = "nns.reduce_scatter"(%0) {axes = ["tp"], dim = 1 : i64} : (tensor<2x16xf32>) -> tensor<2x4xf32>
  %2 = "nns.all_to_all"(%1) {axes = ["dp"], split_dim = 0 : i64, concat_dim = 1 : i64} : (tensor<2x4xf32>) -> tensor<1x8xf32>
  // CHECK: localized.mlir:[[@LINE+1]]:8: error: 'nns.all_gather' result type tensor<2x4xf32> does not follow from the local operand tensor<2x4xf32>: over tp (4 devices) it is tensor<2x16xf32>
  %3 = "nns.all_gather"(%a) {axes = ["tp"], dim = 1 : i64} : (tensor<2x4xf32>) -> tensor<2x4xf32>
  // CHECK: localized.mlir:[[@LINE+1]]:8: error: 'nns.slice' dim 0 of local length 2 cannot be split 4 ways over tp
  %4 = "nns.slice"(%a) {axes = ["tp"], dim = 0 : i64} : (tensor<2x4xf32>) -> tensor<2x4xf32>
  // CHECK: localized.mlir:[[@LINE+1]]:8: error: 'nns.all_reduce' mesh '@world' has no axis 'pp'
  %5 = "nns.all_reduce"(%a) {axes = ["pp"]} : (tensor<2x4xf32>) -> tensor<2x4xf32>
  // CHECK: localized.mlir:[[@LINE+1]]:8: error: 'nns.relayout' cannot appear in a localized function
  %6 = "nns.relayout"(%a) {to = #nns.layout<@world>} : (tensor<2x4xf32>) -> tensor<2x4xf32>
  return %a : tensor<2x4xf32>
}

// -----
// Sizes: a mesh of more than 2^20 devices and tensors of more than 2^50 bytes are refused.
// CHECK: localized.mlir:[[@LINE+1]]:1: error: 'nns.mesh' @world: the mesh has more than 1048576 devices
"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2147483648, tp = 2>} : () -> ()

// -----
// CHECK: localized.mlir:[[@LINE+1]]:1: error: @g argument 0: tensor<1099511627776x1099511627776xf32> is larger than 2^50 bytes
func.func @g(%a: tensor<1099511627776x1099511627776xf32> {nns.name = "a"}) -> (tensor<f32> {nns.name = "r"}) {
  %0 = "dnn.sum"(%a) {dims = array<i64: 0, 1>} : (tensor<1099511627776x1099511627776xf32>) -> tensor<f32>
  return %0 : tensor<f32>
}

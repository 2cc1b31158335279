// Planner constraints verify, print and parse (also with upstream mlir-opt).
// RUN: nnscaler-opt %s | nnscaler-opt | FileCheck %s
// RUN: nnscaler-opt %s | mlir-opt --allow-unregistered-dialect | FileCheck %s
// CHECK: "nns.mesh"() {axes = #nns.axes<dp = 2, tp = 4>, memory_cap = 85899345920 : i64, sym_name = "world"}
// CHECK: "dnn.matmul"(%arg0, %arg1) {nns.colocate = "block0", nns.forbid = #nns.split<k = tp>, nns.pin = #nns.split<m = dp>, nns.stage = 1 : i64, nns.stage_bounds = array<i64: 0, 2>}
"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>, memory_cap = 85899345920 : i64} : () -> ()
func.func @f(%a: tensor<8x16xf32>, %b: tensor<16x4xf32>) -> tensor<8x4xf32> {
  %0 = "dnn.matmul"(%a, %b) {nns.pin = #nns.split<m = dp>, nns.forbid = #nns.split<k = tp>, nns.colocate = "block0", nns.stage = 1 : i64, nns.stage_bounds = array<i64: 0, 2>} : (tensor<8x16xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>
  return %0 : tensor<8x4xf32>
}

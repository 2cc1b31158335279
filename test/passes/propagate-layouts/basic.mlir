// RUN: nnscaler-opt --propagate-layouts --split-tensor %s | FileCheck %s
// RUN: %not nnscaler-opt --propagate-layouts %S/Inputs/no-mesh.mlir 2>&1 | FileCheck %s --check-prefix=NOMESH
// NOMESH: error: propagate-layouts: the module has no nns.mesh

// A directive splits the matmul's summed dim: the lhs must be split on k, the rhs too
// (slices of replicated values), and the result is partial until the return reduces it.
// Ops without directives follow their operands.
// CHECK-LABEL: func.func @f
// CHECK-SAME: -> (tensor<8x4xf32> {nns.layout = #nns.layout<@world>})
// CHECK: %[[E:.*]] = "dnn.exp"(%arg0) {nns.layouts = [#nns.layout<@world, tp = D(1)>], nns.split = #nns.split<*1 = tp>}
// CHECK: %[[S:.*]] = "nns.relayout"(%arg1) {to = #nns.layout<@world, tp = D(0)>}
// CHECK: %[[M:.*]] = "dnn.matmul"(%[[E]], %[[S]]) {nns.layouts = [#nns.layout<@world, tp = V(sum)>], nns.split = #nns.split<k = tp>}
// CHECK: %[[N:.*]] = "dnn.neg"(%[[M]]) {nns.layouts = [#nns.layout<@world, tp = V(sum)>]}
// CHECK: %[[R:.*]] = "nns.relayout"(%[[N]]) {to = #nns.layout<@world>}
// CHECK: return %[[R]]
"nns.mesh"() {sym_name = "world", axes = #nns.axes<tp = 2>} : () -> ()
func.func @f(%x: tensor<8x6xf32> {nns.layout = #nns.layout<@world, tp = D(1)>}, %w: tensor<6x4xf32>) -> tensor<8x4xf32> {
  %e = "dnn.exp"(%x) : (tensor<8x6xf32>) -> tensor<8x6xf32>
  %m = "dnn.matmul"(%e, %w) {nns.split = #nns.split<k = tp>} : (tensor<8x6xf32>, tensor<6x4xf32>) -> tensor<8x4xf32>
  %n = "dnn.neg"(%m) : (tensor<8x4xf32>) -> tensor<8x4xf32>
  return %n : tensor<8x4xf32>
}

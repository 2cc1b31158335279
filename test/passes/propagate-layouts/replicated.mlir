// RUN: nnscaler-opt --propagate-layouts --split-tensor %s | FileCheck %s
// RUN: %not nnscaler-opt --propagate-layouts %S/Inputs/replicated-invalid.mlir 2>&1 | FileCheck %s --check-prefix=BAD

// `R(tp)` in a directive: the op splits nothing over tp, so nothing is inferred over tp
// from its operands; its split operand is gathered first. Over dp it still follows them.
// CHECK-LABEL: func.func @f
// CHECK: %[[E:.*]] = "dnn.exp"(%arg0) {nns.layouts = [#nns.layout<@world, dp = D(0), tp = D(1)>], nns.split = #nns.split<*0 = dp, *1 = tp>}
// CHECK: %[[G:.*]] = "nns.relayout"(%[[E]]) {to = #nns.layout<@world, dp = D(0)>}
// CHECK: "dnn.neg"(%[[G]]) {nns.layouts = [#nns.layout<@world, dp = D(0)>], nns.split = #nns.split<*0 = dp, R(tp)>}
"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 2>} : () -> ()
func.func @f(%x: tensor<8x6xf32> {nns.layout = #nns.layout<@world, dp = D(0), tp = D(1)>}) -> tensor<8x6xf32> {
  %e = "dnn.exp"(%x) : (tensor<8x6xf32>) -> tensor<8x6xf32>
  %n = "dnn.neg"(%e) {nns.split = #nns.split<R(tp)>} : (tensor<8x6xf32>) -> tensor<8x6xf32>
  return %n : tensor<8x6xf32>
}

// BAD: replicated-invalid.mlir:4:8: error: 'dnn.neg' nns.split: mesh '@world' has no axis 'sp'

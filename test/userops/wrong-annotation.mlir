// An annotation that allows a split its body does not compute locally is caught when the
// call is specialized: here k is marked summed, but gelu follows the sum.
// RUN: %not nnscaler-opt --plan=dp --propagate-layouts --split-tensor --lower-relayouts --localize %s 2>&1 | FileCheck %s

// CHECK: wrong-annotation.mlir:[[@LINE+10]]:8: error: localize: the body of @lg cannot compute this call's split without communication: its annotation allows a split its body does not compute (check it with 'nnscaler check-op')
// CHECK: wrong-annotation.mlir:[[@LINE+5]]:8: note: this op of the body needs its operand relayouted

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 2>} : () -> ()
func.func private @lg(%x: tensor<8x16xf32>, %w: tensor<32x16xf32>) -> tensor<8x32xf32> attributes {nns.annotation = "m k+, n k+ -> m n"} {
  %y = "dnn.linear"(%x, %w) : (tensor<8x16xf32>, tensor<32x16xf32>) -> tensor<8x32xf32>
  %z = "dnn.gelu"(%y) : (tensor<8x32xf32>) -> tensor<8x32xf32>
  return %z : tensor<8x32xf32>
}
func.func @train(%x: tensor<8x16xf32> {nns.name = "x"}, %w: tensor<32x16xf32> {nns.name = "w", nns.param}) -> (tensor<8x32xf32> {nns.name = "y"}) {
  %r = func.call @lg(%x, %w) {nns.split = #nns.split<k = tp>} : (tensor<8x16xf32>, tensor<32x16xf32>) -> tensor<8x32xf32>
  return %r : tensor<8x32xf32>
}

// RUN: nnscaler-opt --propagate-layouts --split-tensor %s | FileCheck %s
// RUN: nnscaler check-op %S/Inputs/regroup-op.mlir @regroup | FileCheck %s --check-prefix=OP
// OP: ok    split b over 2 devices: max relative error
// OP-NEXT: ok    split b over 4 devices: max relative error
// RUN: nnscaler check-op %S/Inputs/layout-ops.mlir @swap | FileCheck %s --check-prefix=SWAP
// SWAP: ok    split a over 4 devices
// SWAP: ok    split b over 4 devices
// SWAP: ok    split c over 2 devices
// RUN: nnscaler check-op %S/Inputs/layout-ops.mlir @rotate | FileCheck %s --check-prefix=ROT
// ROT: ok    split a over 4 devices
// RUN: nnscaler check-op %S/Inputs/layout-ops.mlir @merge | FileCheck %s --check-prefix=MERGE
// MERGE: ok    split a over 4 devices
// MERGE: ok    split c over 2 devices
// RUN: nnscaler check-op %S/Inputs/broadcast-op.mlir @tile | FileCheck %s --check-prefix=TILE
// TILE: ok    split a over 2 devices
// TILE: ok    split n over 2 devices: max relative error
// TILE-NEXT: ok    split n over 4 devices: max relative error
// RUN: nnscaler check-op %S/Inputs/broadcast-op.mlir @scale | FileCheck %s --check-prefix=SCALE
// SCALE: ok    split n over 2 devices: max relative error
// SCALE-NEXT: ok    split n over 4 devices: max relative error

// Shape ops carry a split through every dim whose pieces stay contiguous, with no relayout:
// a reshape that regroups factors ((b n) c -> b (n c)) splits its outermost dims by their
// common factor; splitting, merging and regrouping reshapes, transpose, split and concat on
// other dims, and broadcast_to along an existing dim.
// CHECK-LABEL: func.func @regroup
// CHECK: "dnn.reshape"(%arg0) {nns.layouts = [#nns.layout<@world, dp = D(0)>], nns.split = #nns.split<r0 = dp>, shape = array<i64: 4, 12>}
// CHECK-NOT: nns.relayout
// CHECK: "dnn.exp"
// CHECK-LABEL: func.func @shapes
// CHECK-NOT: nns.relayout
// CHECK: "dnn.reshape"(%arg0) {nns.layouts = [#nns.layout<@world, dp = D(0)>]
// CHECK: "dnn.transpose"({{.*}}) {nns.layouts = [#nns.layout<@world, dp = D(0)>]
// CHECK: "dnn.split"({{.*}}) {dim = 1 : i64, nns.layouts = [#nns.layout<@world, dp = D(0)>, #nns.layout<@world, dp = D(0)>]
// CHECK: "dnn.concat"({{.*}}) {dim = 1 : i64, nns.layouts = [#nns.layout<@world, dp = D(0)>]
// CHECK: "dnn.reshape"({{.*}}) {nns.layouts = [#nns.layout<@world, dp = D(0)>], nns.split = #nns.split<r0 = dp>, shape = array<i64: 12, 2>}
// CHECK: "dnn.reshape"({{.*}}) {nns.layouts = [#nns.layout<@world, dp = D(0)>], nns.split = #nns.split<r0 = dp>, shape = array<i64: 4, 6>}
// CHECK: "dnn.broadcast_to"(%arg1) {nns.layouts = [#nns.layout<@world, dp = D(0)>]
// CHECK: "dnn.reshape"({{.*}}) {nns.layouts = [#nns.layout<@world, dp = D(0)>], nns.split = #nns.split<r0 = dp>, shape = array<i64: 8, 3>}
// CHECK: "dnn.reshape"({{.*}}) {nns.layouts = [#nns.layout<@world, dp = D(0)>], nns.split = #nns.split<r0 = dp>, shape = array<i64: 2, 12>}
// CHECK: "dnn.reshape"({{.*}}) {nns.layouts = [#nns.layout<@world, dp = D(0)>], nns.split = #nns.split<r0 = dp>, shape = array<i64: 8, 3>}
// CHECK: "nns.relayout"({{.*}}) {to = #nns.layout<@world>}
// CHECK-NEXT: return
// broadcast_to into a new leading dim (`a=8` in its annotation, in no operand) that its
// consumer needs split: the broadcast is split there, directly or through a chain of
// single-use ops, instead of made whole and cut.
// CHECK-LABEL: func.func @lead
// CHECK-NOT: nns.relayout
// CHECK: "dnn.broadcast_to"(%arg0) {nns.layouts = [#nns.layout<@world, dp = D(0)>], nns.split = #nns.split<a = dp>, shape = array<i64: 8, 4, 6>}
// CHECK: "dnn.exp"({{.*}}) {nns.layouts = [#nns.layout<@world, dp = D(0)>], nns.split = #nns.split<*0 = dp>}
// CHECK: "dnn.add"
// CHECK: "nns.relayout"({{.*}}) {to = #nns.layout<@world>}
// CHECK-NEXT: return
// A broadcast with a second use is left whole (its other consumer reads it whole).
// CHECK-LABEL: func.func @shared
// CHECK: "dnn.broadcast_to"(%arg0) {nns.layouts = [#nns.layout<@world>], shape
// CHECK: "nns.relayout"
// Factors with nothing in common ([2, 15] -> [3, 10]): no split survives the reshape, so
// the operand is made whole first.
// CHECK-LABEL: func.func @frozen
// CHECK: "nns.relayout"(%arg0) {to = #nns.layout<@world>}
// CHECK: "dnn.reshape"
"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2>} : () -> ()
func.func @regroup(%x: tensor<8x6xf32> {nns.layout = #nns.layout<@world, dp = D(0)>}) -> tensor<4x12xf32> {
  %r = "dnn.reshape"(%x) {shape = array<i64: 4, 12>} : (tensor<8x6xf32>) -> tensor<4x12xf32>
  %e = "dnn.exp"(%r) : (tensor<4x12xf32>) -> tensor<4x12xf32>
  return %e : tensor<4x12xf32>
}
func.func @shapes(%x: tensor<4x6xf32> {nns.layout = #nns.layout<@world, dp = D(0)>}, %y: tensor<4x1xf32> {nns.layout = #nns.layout<@world, dp = D(0)>}) -> tensor<8x3xf32> {
  %a = "dnn.reshape"(%x) {shape = array<i64: 2, 2, 6>} : (tensor<4x6xf32>) -> tensor<2x2x6xf32>
  %b = "dnn.transpose"(%a) {perm = array<i64: 0, 2, 1>} : (tensor<2x2x6xf32>) -> tensor<2x6x2xf32>
  %c:2 = "dnn.split"(%b) {dim = 1 : i64, sizes = array<i64: 2, 4>} : (tensor<2x6x2xf32>) -> (tensor<2x2x2xf32>, tensor<2x4x2xf32>)
  %d = "dnn.concat"(%c#1, %c#0) {dim = 1 : i64} : (tensor<2x4x2xf32>, tensor<2x2x2xf32>) -> tensor<2x6x2xf32>
  %f = "dnn.reshape"(%d) {shape = array<i64: 12, 2>} : (tensor<2x6x2xf32>) -> tensor<12x2xf32>
  %g = "dnn.reshape"(%f) {shape = array<i64: 4, 6>} : (tensor<12x2xf32>) -> tensor<4x6xf32>
  %h = "dnn.broadcast_to"(%y) {shape = array<i64: 4, 6>} : (tensor<4x1xf32>) -> tensor<4x6xf32>
  %i = "dnn.add"(%g, %h) : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32>
  %j = "dnn.reshape"(%i) {shape = array<i64: 8, 3>} : (tensor<4x6xf32>) -> tensor<8x3xf32>
  %k = "dnn.reshape"(%j) {shape = array<i64: 2, 12>} : (tensor<8x3xf32>) -> tensor<2x12xf32>
  %l = "dnn.reshape"(%k) {shape = array<i64: 8, 3>} : (tensor<2x12xf32>) -> tensor<8x3xf32>
  return %l : tensor<8x3xf32>
}
func.func @lead(%x: tensor<4x6xf32>, %y: tensor<8x4x6xf32> {nns.layout = #nns.layout<@world, dp = D(0)>}) -> tensor<8x4x6xf32> {
  %b = "dnn.broadcast_to"(%x) {shape = array<i64: 8, 4, 6>} : (tensor<4x6xf32>) -> tensor<8x4x6xf32>
  %e = "dnn.exp"(%b) : (tensor<8x4x6xf32>) -> tensor<8x4x6xf32>
  %s = "dnn.add"(%e, %y) : (tensor<8x4x6xf32>, tensor<8x4x6xf32>) -> tensor<8x4x6xf32>
  return %s : tensor<8x4x6xf32>
}
func.func @shared(%x: tensor<4x6xf32>, %y: tensor<8x4x6xf32> {nns.layout = #nns.layout<@world, dp = D(0)>}) -> (tensor<8x4x6xf32>, tensor<8x4x6xf32>) {
  %b = "dnn.broadcast_to"(%x) {shape = array<i64: 8, 4, 6>} : (tensor<4x6xf32>) -> tensor<8x4x6xf32>
  %s = "dnn.add"(%b, %y) : (tensor<8x4x6xf32>, tensor<8x4x6xf32>) -> tensor<8x4x6xf32>
  return %s, %b : tensor<8x4x6xf32>, tensor<8x4x6xf32>
}
func.func @frozen(%x: tensor<2x15xf32> {nns.layout = #nns.layout<@world, dp = D(0)>}) -> tensor<3x10xf32> {
  %r = "dnn.reshape"(%x) {shape = array<i64: 3, 10>} : (tensor<2x15xf32>) -> tensor<3x10xf32>
  return %r : tensor<3x10xf32>
}

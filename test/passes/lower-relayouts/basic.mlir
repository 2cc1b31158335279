// RUN: nnscaler-opt --lower-relayouts --split-input-file --verify-diagnostics %s | FileCheck %s

// Each relayout becomes the cheapest collective sequence from its operand's layout.
// CHECK-LABEL: func.func @table
// CHECK: %[[A:.*]] = "nns.all_reduce"(%arg0) {axes = ["dp", "tp"], nns.layouts = [#nns.layout<@world>], reduce = "sum"}
// CHECK: %[[B:.*]] = "nns.reduce_scatter"(%arg0) {axes = ["tp"], dim = 1 : i64, nns.layouts = [#nns.layout<@world, dp = V(sum), tp = D(1)>], reduce = "sum"}
// CHECK: %[[C:.*]] = "nns.all_to_all"(%arg1) {axes = ["tp"], concat_dim = 0 : i64, nns.layouts = [#nns.layout<@world, tp = D(1)>], split_dim = 1 : i64}
// CHECK: %[[D:.*]] = "nns.all_gather"(%arg1) {axes = ["tp"], dim = 0 : i64, nns.layouts = [#nns.layout<@world>]}
// CHECK: %[[E:.*]] = "nns.slice"(%[[D]]) {axes = ["dp"], dim = 0 : i64, nns.layouts = [#nns.layout<@world, dp = D(0)>]}
// CHECK: return %[[A]], %[[B]], %[[C]], %[[E]]
"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
func.func @table(%v: tensor<8x8xf32> {nns.layout = #nns.layout<@world, dp = V(sum), tp = V(sum)>},
                 %d: tensor<8x8xf32> {nns.layout = #nns.layout<@world, tp = D(0)>})
    -> (tensor<8x8xf32>, tensor<8x8xf32>, tensor<8x8xf32>, tensor<8x8xf32>) {
  %0 = "nns.relayout"(%v) {to = #nns.layout<@world>} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  %1 = "nns.relayout"(%v) {to = #nns.layout<@world, dp = V(sum), tp = D(1)>} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  %2 = "nns.relayout"(%d) {to = #nns.layout<@world, tp = D(1)>} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  %3 = "nns.relayout"(%d) {to = #nns.layout<@world, dp = D(0)>} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  return %0, %1, %2, %3 : tensor<8x8xf32>, tensor<8x8xf32>, tensor<8x8xf32>, tensor<8x8xf32>
}

// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<tp = 2>} : () -> ()
func.func @no_route(%r: tensor<4x4xf32>) -> tensor<4x4xf32> {
  // expected-error@+1 {{lower-relayouts: no collective sequence turns @world into @world, tp = V(max)}}
  %0 = "nns.relayout"(%r) {to = #nns.layout<@world, tp = V(max)>} : (tensor<4x4xf32>) -> tensor<4x4xf32>
  return %0 : tensor<4x4xf32>
}

// A transformer MLP block: layer norm, fc (column-parallel), gelu, proj (row-parallel),
// residual add.
// RUN: nnscaler-opt --autodiff --plan="megatron tp=2" --propagate-layouts --split-tensor --lower-relayouts %s | FileCheck %s --check-prefix=TP
// RUN: nnscaler-opt --autodiff --plan="dp dp=2" --propagate-layouts --split-tensor --lower-relayouts %s | FileCheck %s --check-prefix=DP
// RUN: nnscaler-opt --autodiff --plan="dp-megatron dp=2 tp=2" --propagate-layouts --split-tensor --lower-relayouts %s | FileCheck %s --check-prefix=HYBRID
// RUN: nnscaler-opt --autodiff --plan="megatron-sp tp=2" --propagate-layouts --split-tensor --lower-relayouts %s | FileCheck %s --check-prefix=SP

// Megatron: the weights are sharded, exactly one all_reduce in forward and one in
// backward (the input gradient, before the layer norm's VJP).
// TP: "nns.mesh"() {axes = #nns.axes<tp = 2>, sym_name = "world"}
// TP-LABEL: func.func @train
// TP-SAME{LITERAL}: %arg2: tensor<64x16xf32> {nns.layout = #nns.layout<@world, tp = D(0)>, nns.name = "fc.weight", nns.param}
// TP-SAME{LITERAL}: %arg3: tensor<64xf32> {nns.layout = #nns.layout<@world, tp = D(0)>, nns.name = "fc.bias", nns.param}
// TP-SAME{LITERAL}: %arg4: tensor<16x64xf32> {nns.layout = #nns.layout<@world, tp = D(1)>, nns.name = "proj.weight", nns.param}
// TP: "dnn.linear"{{.*}}nns.split = #nns.split<n = tp>
// TP: "dnn.gelu"{{.*}}#nns.layout<@world, tp = D(2)>
// TP: %[[P:.*]] = "dnn.linear"{{.*}}nns.split = #nns.split<k = tp>
// The bias and the residual join the partial sum locally (value / 2 on each device)...
// TP: %[[B:.*]] = "nns.partition"(%arg5) {axes = ["tp"]
// TP: "dnn.add"(%[[P]], %[[B]])
// TP-NOT: "nns.all_reduce"
// TP: "nns.partition"(%arg0)
// ...and one all_reduce makes the result whole before the loss.
// TP: %[[R:.*]] = "nns.all_reduce"
// TP-NOT: "nns.all_reduce"
// TP: "dnn.cross_entropy"(%[[R]], %arg1)
// TP: "nns.all_reduce"{{.*}}axes = ["tp"]
// TP: "dnn.layer_norm_grad"
// TP-NOT: nns.all_reduce
// TP: return

// Data parallel: one all_reduce per parameter gradient, and one for the loss.
// DP-COUNT-7: "nns.all_reduce"{{.*}}axes = ["dp"]
// DP-NOT: "nns.all_reduce"
// DP-NOT: "nns.all_gather"
// DP: return

// Both: tensor-parallel all_reduces stay on tp; gradients of replicated parameters are
// reduced over dp and tp together only where they are partial on both.
// HYBRID: "nns.all_reduce"{{.*}}axes = ["tp"]
// HYBRID-NOT: "nns.all_gather"
// HYBRID: return

// Sequence parallel: the layer norm and the residual add run on a sequence shard; the
// column-parallel linear gathers its input; the row-parallel result (with its bias joined
// through a local nns.partition) is reduce-scattered back onto the sequence.
// SP{LITERAL}: %arg0: tensor<4x8x16xf32> {nns.layout = #nns.layout<@world, tp = D(1)>, nns.name = "x"}
// SP: "dnn.layer_norm"{{.*}}#nns.layout<@world, tp = D(1)>
// SP: "nns.all_gather"{{.*}}axes = ["tp"], dim = 1
// SP: "dnn.linear"{{.*}}nns.split = #nns.split<n = tp>
// SP: %[[P:.*]] = "dnn.linear"{{.*}}nns.split = #nns.split<k = tp>
// SP: %[[B:.*]] = "nns.partition"(%arg5)
// SP: %[[S:.*]] = "dnn.add"(%[[P]], %[[B]]) {{.*}}tp = V(sum)
// SP: %[[RS:.*]] = "nns.reduce_scatter"(%[[S]]) {axes = ["tp"], dim = 1
// SP: "dnn.add"(%[[RS]], %arg0) {{.*}}#nns.layout<@world, tp = D(1)>
// SP: "nns.reduce_scatter"{{.*}}axes = ["tp"], dim = 1

func.func @train(%x: tensor<4x8x16xf32> {nns.name = "x"}, %y: tensor<32xi64> {nns.name = "labels"},
                 %fw: tensor<64x16xf32> {nns.name = "fc.weight", nns.param}, %fb: tensor<64xf32> {nns.name = "fc.bias", nns.param},
                 %pw: tensor<16x64xf32> {nns.name = "proj.weight", nns.param}, %pb: tensor<16xf32> {nns.name = "proj.bias", nns.param},
                 %lw: tensor<16xf32> {nns.name = "ln.weight", nns.param}, %lb: tensor<16xf32> {nns.name = "ln.bias", nns.param})
    -> (tensor<f32> {nns.name = "loss"}) {
  %h = "dnn.layer_norm"(%x, %lw, %lb) : (tensor<4x8x16xf32>, tensor<16xf32>, tensor<16xf32>) -> tensor<4x8x16xf32>
  %f = "dnn.linear"(%h, %fw, %fb) : (tensor<4x8x16xf32>, tensor<64x16xf32>, tensor<64xf32>) -> tensor<4x8x64xf32>
  %g = "dnn.gelu"(%f) : (tensor<4x8x64xf32>) -> tensor<4x8x64xf32>
  %p = "dnn.linear"(%g, %pw, %pb) : (tensor<4x8x64xf32>, tensor<16x64xf32>, tensor<16xf32>) -> tensor<4x8x16xf32>
  %r = "dnn.add"(%p, %x) : (tensor<4x8x16xf32>, tensor<4x8x16xf32>) -> tensor<4x8x16xf32>
  %l = "dnn.reshape"(%r) {shape = array<i64: 32, 16>} : (tensor<4x8x16xf32>) -> tensor<32x16xf32>
  %c = "dnn.cross_entropy"(%l, %y) : (tensor<32x16xf32>, tensor<32xi64>) -> tensor<f32>
  return %c : tensor<f32>
}

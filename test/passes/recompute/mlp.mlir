// --recompute clones a layer's forward ops into its backward; the backward reads the
// clones, so only the layer's input is kept from the forward. Layers come from parameter
// names (l.0.*, l.1.*); the head (no index) is in no layer.
// RUN: nnscaler-opt --autodiff --recompute=full %s 2>&1 | FileCheck %s --check-prefix=FULL
// RUN: nnscaler-opt --autodiff --recompute=selective %s 2>&1 | FileCheck %s --check-prefix=SEL
// RUN: nnscaler-opt --autodiff --print-stats %s -o /dev/null 2>&1 | FileCheck %s --check-prefix=STATS
// RUN: nnscaler-opt --place="stages=2 layout=t|t,L" --autodiff --recompute=full %s 2>&1 | FileCheck %s --check-prefix=STAGED
// RUN: %not nnscaler-opt --recompute %s 2>&1 | FileCheck %s --check-prefix=NOAD
// RUN: %not nnscaler-opt --autodiff --recompute=some %s 2>&1 | FileCheck %s --check-prefix=BADPOL

func.func @train(%x: tensor<8x16xf32> {nns.name = "x"}, %y: tensor<8xi64> {nns.name = "y"},
                 %w0: tensor<16x16xf32> {nns.name = "l.0.w", nns.param},
                 %w1: tensor<16x16xf32> {nns.name = "l.1.w", nns.param},
                 %wh: tensor<4x16xf32> {nns.name = "head.w", nns.param}) -> (tensor<f32> {nns.name = "loss"}) {
  %h0 = "dnn.linear"(%x, %w0) : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
  %a0 = "dnn.gelu"(%h0) : (tensor<8x16xf32>) -> tensor<8x16xf32>
  %h1 = "dnn.linear"(%a0, %w1) : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
  %a1 = "dnn.gelu"(%h1) : (tensor<8x16xf32>) -> tensor<8x16xf32>
  %o = "dnn.linear"(%a1, %wh) : (tensor<8x16xf32>, tensor<4x16xf32>) -> tensor<8x4xf32>
  %l = "dnn.cross_entropy"(%o, %y) : (tensor<8x4xf32>, tensor<8xi64>) -> tensor<f32>
  return %l : tensor<f32>
}

// FULL: remark: recompute @train: 4 forward ops recomputed in the backward (full)
// FULL: %[[H0:.*]] = "dnn.linear"(%arg0, %arg2) :
// FULL-NEXT: %[[A0:.*]] = "dnn.gelu"(%[[H0]]) :
// FULL: "dnn.cross_entropy_grad"
// Layer 1 again, from its input %a0, before the first backward op reading it (the head's
// weight gradient reads the layer's output).
// FULL: %[[R1:.*]] = "dnn.linear"(%[[A0]], %arg3) {nns.recompute}
// FULL-NEXT: %[[R1A:.*]] = "dnn.gelu"(%[[R1]]) {nns.recompute}
// FULL-NEXT: "dnn.linear_weight_grad"({{.*}}, %[[R1A]])
// FULL-NEXT: "dnn.gelu_grad"({{.*}}, %[[R1]])
// Layer 0 from its input, the data %arg0.
// FULL: %[[R0:.*]] = "dnn.linear"(%arg0, %arg2) {nns.recompute}
// FULL-NEXT: %[[R0A:.*]] = "dnn.gelu"(%[[R0]]) {nns.recompute}
// FULL-NEXT: "dnn.linear_weight_grad"({{.*}}, %[[R0A]])
// FULL-NEXT: "dnn.gelu_grad"({{.*}}, %[[R0]])

// Selective keeps the matrix products' outputs and recomputes the rest.
// SEL: remark: recompute @train: 2 forward ops recomputed in the backward (selective)
// SEL-NOT: "dnn.linear"{{.*}}nns.recompute
// SEL: "dnn.gelu"{{.*}}nns.recompute

// Only what the backward reads runs again: with layer 1 on a stage of its own, layer 0's
// output a0 reaches layer 1's backward as the value stage 0 sent, so stage 0 recomputes
// its linear (its gradient reads h0) and not its gelu, which nothing would read.
// STAGED: remark: recompute @train: 3 forward ops recomputed in the backward (full)
// STAGED: "dnn.linear"{{.*}}nns.recompute, nns.stage = 1
// STAGED-NEXT: "dnn.gelu"{{.*}}nns.recompute, nns.stage = 1
// STAGED: "dnn.linear"{{.*}}nns.recompute, nns.stage = 0
// STAGED-NOT: "dnn.gelu"{{.*}}nns.recompute, nns.stage = 0

// Kept from the forward: h0, a0, h1, a1 and the logits (2.12 KiB); with full recompute only
// layer 1's input a0 and the logits; with selective, the linears' outputs and the logits.
// STATS: saved for the backward: 2.12 KiB (values forward ops produce that the backward reads, for this program's batch; with --recompute=full 640.00 B, selective 1.12 KiB)

// NOAD: error: recompute: @train has no backward to recompute in; run --autodiff first
// BADPOL: recompute: unknown policy 'some' (policies: full, selective)

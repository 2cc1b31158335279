// Planner constraints on ops are honoured or the plan is an error, never silently dropped.
// RUN: %not nnscaler-opt --plan="megatron tp=2" --propagate-layouts --split-input-file %s 2>&1 | FileCheck %s
// RUN: nnscaler-opt --propagate-layouts --split-input-file %S/Inputs/pin.mlir | FileCheck %s --check-prefix=PIN

"nns.mesh"() {sym_name = "world", axes = #nns.axes<tp = 2>} : () -> ()
func.func @train(%x: tensor<4x8x16xf32> {nns.name = "x"}, %y: tensor<32xi64> {nns.name = "labels"},
                 %fw: tensor<64x16xf32> {nns.name = "fc.weight", nns.param}, %fb: tensor<64xf32> {nns.name = "fc.bias", nns.param},
                 %pw: tensor<16x64xf32> {nns.name = "proj.weight", nns.param}, %pb: tensor<16xf32> {nns.name = "proj.bias", nns.param})
    -> (tensor<f32> {nns.name = "loss"}) {
  // Megatron makes fc column-parallel (n = tp), which its nns.forbid forbids.
  // CHECK: constraints.mlir:[[@LINE+1]]:8: error: propagate-layouts: 'dnn.linear': its split directive (nns.split or nns.pin) split 'n' over tp, which its nns.forbid forbids
  %f = "dnn.linear"(%x, %fw, %fb) {nns.forbid = #nns.split<n = tp>} : (tensor<4x8x16xf32>, tensor<64x16xf32>, tensor<64xf32>) -> tensor<4x8x64xf32>
  %g = "dnn.gelu"(%f) : (tensor<4x8x64xf32>) -> tensor<4x8x64xf32>
  %p = "dnn.linear"(%g, %pw, %pb) : (tensor<4x8x64xf32>, tensor<16x64xf32>, tensor<16xf32>) -> tensor<4x8x16xf32>
  %l = "dnn.reshape"(%p) {shape = array<i64: 32, 16>} : (tensor<4x8x16xf32>) -> tensor<32x16xf32>
  %c = "dnn.cross_entropy"(%l, %y) : (tensor<32x16xf32>, tensor<32xi64>) -> tensor<f32>
  return %c : tensor<f32>
}

// -----
"nns.mesh"() {sym_name = "world", axes = #nns.axes<tp = 2>} : () -> ()
func.func @train(%x: tensor<4x8x16xf32> {nns.name = "x"}, %y: tensor<32xi64> {nns.name = "labels"},
                 %fw: tensor<64x16xf32> {nns.name = "fc.weight", nns.param}, %fb: tensor<64xf32> {nns.name = "fc.bias", nns.param},
                 %pw: tensor<16x64xf32> {nns.name = "proj.weight", nns.param}, %pb: tensor<16xf32> {nns.name = "proj.bias", nns.param})
    -> (tensor<f32> {nns.name = "loss"}) {
  %f = "dnn.linear"(%x, %fw, %fb) : (tensor<4x8x16xf32>, tensor<64x16xf32>, tensor<64xf32>) -> tensor<4x8x64xf32>
  %g = "dnn.gelu"(%f) : (tensor<4x8x64xf32>) -> tensor<4x8x64xf32>
  // proj feeds the cross-entropy: megatron makes it a vocabulary-parallel head (n = tp),
  // which its nns.forbid forbids.
  // CHECK: constraints.mlir:[[@LINE+1]]:8: error: propagate-layouts: 'dnn.linear': its split directive (nns.split or nns.pin) split 'n' over tp, which its nns.forbid forbids
  %p = "dnn.linear"(%g, %pw, %pb) {nns.forbid = #nns.split<n = tp>} : (tensor<4x8x64xf32>, tensor<16x64xf32>, tensor<16xf32>) -> tensor<4x8x16xf32>
  %l = "dnn.reshape"(%p) {shape = array<i64: 32, 16>} : (tensor<4x8x16xf32>) -> tensor<32x16xf32>
  %c = "dnn.cross_entropy"(%l, %y) : (tensor<32x16xf32>, tensor<32xi64>) -> tensor<f32>
  return %c : tensor<f32>
}

// PIN: "dnn.matmul"(%arg0, %arg1) {nns.layouts = [#nns.layout<@world, tp = D(0)>], nns.pin = #nns.split<m = tp>, nns.split = #nns.split<m = tp>}

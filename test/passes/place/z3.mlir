// --place solves with Z3 over layers (here l.0 .. l.3 from the parameter names): the
// optimum equals the dynamic program's; a memory cap on the mesh that no placement meets
// is reported with the stages whose caps conflict; layout= places explicitly.
// RUN: nnscaler-opt --place="stages=3" %s -o /dev/null 2>&1 | FileCheck %s --check-prefix=Z3
// RUN: nnscaler-opt --place="stages=3 solver=dp" %s -o /dev/null 2>&1 | FileCheck %s --check-prefix=Z3
// RUN: nnscaler-opt --place="layout=t*2|t,t|L" %s 2>&1 | FileCheck %s --check-prefix=LAYOUT
// RUN: sed 's/dp = 1>/dp = 1>, memory_cap = 40000 : i64/' %s | %not nnscaler-opt --place="stages=3" 2>&1 | FileCheck %s --check-prefix=CAP
// RUN: sed 's/dp = 1>/dp = 1>, memory_cap = 200000 : i64/' %s | nnscaler-opt --place="stages=3" -o /dev/null 2>&1 | FileCheck %s --check-prefix=Z3
// RUN: %not nnscaler-opt --place="layout=E,t*3|t,L" %s 2>&1 | FileCheck %s --check-prefix=BADLAYOUT
// RUN: %not nnscaler-opt --place="stages=3 solver=cplex" %s 2>&1 | FileCheck %s --check-prefix=SOLVER

"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 1>} : () -> ()
func.func @train(%x: tensor<8x64xf32> {nns.name = "x"}, %y: tensor<8xi64> {nns.name = "y"},
                 %w0: tensor<64x64xf32> {nns.name = "l.0.w", nns.param},
                 %w1: tensor<64x64xf32> {nns.name = "l.1.w", nns.param},
                 %w2: tensor<64x64xf32> {nns.name = "l.2.w", nns.param},
                 %w3: tensor<64x64xf32> {nns.name = "l.3.w", nns.param},
                 %wh: tensor<4x64xf32> {nns.name = "head.w", nns.param}) -> (tensor<f32> {nns.name = "loss"}) {
  %h0 = "dnn.linear"(%x, %w0) : (tensor<8x64xf32>, tensor<64x64xf32>) -> tensor<8x64xf32>
  %a0 = "dnn.gelu"(%h0) : (tensor<8x64xf32>) -> tensor<8x64xf32>
  %h1 = "dnn.linear"(%a0, %w1) : (tensor<8x64xf32>, tensor<64x64xf32>) -> tensor<8x64xf32>
  %a1 = "dnn.gelu"(%h1) : (tensor<8x64xf32>) -> tensor<8x64xf32>
  %h2 = "dnn.linear"(%a1, %w2) : (tensor<8x64xf32>, tensor<64x64xf32>) -> tensor<8x64xf32>
  %a2 = "dnn.gelu"(%h2) : (tensor<8x64xf32>) -> tensor<8x64xf32>
  %h3 = "dnn.linear"(%a2, %w3) : (tensor<8x64xf32>, tensor<64x64xf32>) -> tensor<8x64xf32>
  %a3 = "dnn.gelu"(%h3) : (tensor<8x64xf32>) -> tensor<8x64xf32>
  %o = "dnn.linear"(%a3, %wh) : (tensor<8x64xf32>, tensor<4x64xf32>) -> tensor<8x4xf32>
  %l = "dnn.cross_entropy"(%o, %y) : (tensor<8x4xf32>, tensor<8xi64>) -> tensor<f32>
  return %l : tensor<f32>
}

// Four equal layers in three stages: the slowest stage holds two layers.
// Z3: remark: place @train: 3 stages; {{.*}} 1.393e5 FLOPs; {{.*}} slowest / mean = 1.477

// LAYOUT: "dnn.linear"(%arg0, %arg2) {nns.stage = 0 : i64}
// LAYOUT: "dnn.linear"(%{{.*}}, %arg3) {nns.stage = 0 : i64}
// LAYOUT: "dnn.linear"(%{{.*}}, %arg4) {nns.stage = 1 : i64}
// LAYOUT: "dnn.linear"(%{{.*}}, %arg5) {nns.stage = 1 : i64}
// LAYOUT: "dnn.linear"(%{{.*}}, %arg6) {nns.stage = 2 : i64}
// LAYOUT: "dnn.cross_entropy"{{.*}}nns.stage = 2 : i64

// Each layer needs 4 x 16 KiB for its weight, gradient and Adam moments: 40000 bytes per
// device hold none of them.
// CAP: error: place: no placement of @train in 3 stages satisfies these together: the memory cap of 40000 bytes per device on stage

// BADLAYOUT: error: place: layout 'E,t*3|t,L' lists E, 4 layers, L but the program has 4 layers, L
// SOLVER: place: unknown solver 'cplex' (solvers: z3, dp)

// ZB-H1, p = 2, m = 4, on the example of test/passes/schedule-1f1b/literal.mlir: the
// backward split into B (what the earlier stage waits for: the input gradient) and W (the
// weight gradients), each rank's W filling its bubble. Stage 0 has no B fragment (no
// earlier stage waits for it), so only its W runs.
// RUN: nnscaler-opt --autodiff %S/../schedule-1f1b/literal.mlir -o %t.train.mlir
// RUN: nnscaler-opt --split-tensor --schedule-zb-h1 %t.train.mlir 2>/dev/null | FileCheck %s
// RUN: nnscaler-opt --split-tensor --schedule-zb-h1 --lower-relayouts --localize %t.train.mlir -o %t.run.mlir
// RUN: %python -c "import sys; sys.path.insert(0, '%oracle'); import st, numpy as np; r = np.random.default_rng(1); st.save('%t.in.safetensors', {'x': r.standard_normal((16, 8)).astype(np.float32), 'y': r.integers(0, 4, (16,))})"
// RUN: nnscaler run %t.train.mlir --inputs %t.in.safetensors --init-seed 5 -o %t.one.safetensors
// RUN: nnscaler run %t.run.mlir --inputs %t.in.safetensors --init-seed 5 -o %t.pp.safetensors
// RUN: %python %S/../../tools/Inputs/allclose.py %t.pp.safetensors %t.one.safetensors 1e-5 %oracle | FileCheck %s --check-prefix=SAME
// SAME: allclose: 3 tensors

// CHECK-LABEL: func.func private @train.s0.F(
// CHECK-NOT: func.func private @train.s0.B(
// CHECK-LABEL: func.func private @train.s0.W(
// CHECK: "dnn.linear_weight_grad"
// CHECK-LABEL: func.func private @train.s1.F(
// CHECK-LABEL: func.func private @train.s1.B(
// The input gradient (sent to stage 0) is all B computes.
// CHECK: "dnn.cross_entropy_grad"
// CHECK-NEXT: "dnn.matmul"
// CHECK-NEXT: return
// CHECK-LABEL: func.func private @train.s1.W(
// CHECK: "dnn.linear_weight_grad"
// CHECK-LABEL: func.func @train.pp0(
// CHECK-SAME: nns.schedule = "zb-h1: 0F0 0F1 0B0 0W0 0F2 0B1 0W1 0F3 0B2 0W2 0B3 0W3"
// CHECK: nns.fragment = "0F0"
// CHECK: nns.fragment = "0F1"
// CHECK: nns.fragment = "0W0"
// CHECK: nns.fragment = "0F2"
// CHECK: nns.fragment = "0W1"
// CHECK: nns.fragment = "0F3"
// CHECK: nns.fragment = "0W2"
// CHECK: nns.fragment = "0W3"
// CHECK-LABEL: func.func @train.pp1(
// CHECK-SAME: nns.schedule = "zb-h1: 1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1F3 1B3 1W2 1W3"
// CHECK: nns.fragment = "1F0"
// CHECK: nns.fragment = "1B0"
// CHECK-NEXT: "nns.send"
// CHECK: nns.fragment = "1F1"
// CHECK: nns.fragment = "1B1"
// CHECK: nns.fragment = "1W0"
// CHECK: nns.fragment = "1F2"
// CHECK: nns.fragment = "1B2"
// CHECK: nns.fragment = "1W1"
// CHECK: nns.fragment = "1F3"
// CHECK: nns.fragment = "1B3"
// CHECK: nns.fragment = "1W2"
// CHECK: nns.fragment = "1W3"

// --autocast="bf16 activations=bf16": every forward op that reads a float reads and writes
// bf16 (norms, elementwise ops, the products), except those that write a scalar or a
// function result (the loss, a sum over everything), which read f32. An activation is cast
// where its first reader needs the other type, once; a parameter is cast at each use, so
// its gradient is summed in f32; a value computed from no float (a fill) stays f32 and is
// cast once for its bf16 readers.
// RUN: nnscaler-opt --autocast="bf16 activations=bf16" %s 2>&1 | FileCheck %s
// RUN: nnscaler-opt --autocast="bf16 activations=bf16" --autodiff %s 2>&1 | FileCheck %s --check-prefix=GRAD

func.func @train(%x: tensor<8x16xf32> {nns.name = "x"}, %y: tensor<8xi64> {nns.name = "y"},
                 %w: tensor<16x16xf32> {nns.name = "w", nns.param},
                 %g: tensor<16xf32> {nns.name = "g", nns.param}) -> (tensor<f32> {nns.name = "loss"}) {
  %h = "dnn.linear"(%x, %w) : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
  %n = "dnn.rms_norm"(%h, %g) {eps = 1.0e-5 : f64} : (tensor<8x16xf32>, tensor<16xf32>) -> tensor<8x16xf32>
  %o = "dnn.linear"(%n, %w) : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
  %one = "dnn.fill"() {shape = array<i64: 8, 16>, value = 1.0 : f64} : () -> tensor<8x16xf32>
  %a = "dnn.add"(%o, %one) : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<8x16xf32>
  %b = "dnn.mul"(%n, %one) : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<8x16xf32>
  %s = "dnn.sum"(%b) {dims = array<i64: 0, 1>} : (tensor<8x16xf32>) -> tensor<f32>
  %l = "dnn.cross_entropy"(%a, %y) : (tensor<8x16xf32>, tensor<8xi64>) -> tensor<f32>
  %t = "dnn.add"(%l, %s) : (tensor<f32>, tensor<f32>) -> tensor<f32>
  return %t : tensor<f32>
}

// CHECK: remark: autocast @train: 5 ops (every activation) in bf16
// CHECK: %[[X:.*]] = "dnn.cast"(%arg0) {to = "bf16"}
// CHECK-NEXT: %[[W1:.*]] = "dnn.cast"(%arg2) {to = "bf16"}
// CHECK-NEXT: %[[H:.*]] = "dnn.linear"(%[[X]], %[[W1]]) : (tensor<8x16xbf16>, tensor<16x16xbf16>) -> tensor<8x16xbf16>
// CHECK-NEXT: %[[G:.*]] = "dnn.cast"(%arg3) {to = "bf16"}
// CHECK-NEXT: %[[N:.*]] = "dnn.rms_norm"(%[[H]], %[[G]]) {{.*}} -> tensor<8x16xbf16>
// CHECK-NEXT: %[[W2:.*]] = "dnn.cast"(%arg2) {to = "bf16"}
// CHECK-NEXT: %[[O:.*]] = "dnn.linear"(%[[N]], %[[W2]])
// CHECK-NEXT: %[[ONE:.*]] = "dnn.fill"() {{.*}} -> tensor<8x16xf32>
// CHECK-NEXT: %[[ONE16:.*]] = "dnn.cast"(%[[ONE]]) {to = "bf16"}
// CHECK-NEXT: %[[A:.*]] = "dnn.add"(%[[O]], %[[ONE16]]) : (tensor<8x16xbf16>, tensor<8x16xbf16>) -> tensor<8x16xbf16>
// CHECK-NEXT: %[[B:.*]] = "dnn.mul"(%[[N]], %[[ONE16]]) : (tensor<8x16xbf16>, tensor<8x16xbf16>) -> tensor<8x16xbf16>
// CHECK-NEXT: %[[B32:.*]] = "dnn.cast"(%[[B]]) {to = "f32"}
// CHECK-NEXT: %[[S:.*]] = "dnn.sum"(%[[B32]]) {{.*}} : (tensor<8x16xf32>) -> tensor<f32>
// CHECK-NEXT: %[[A32:.*]] = "dnn.cast"(%[[A]]) {to = "f32"}
// CHECK-NEXT: %[[L:.*]] = "dnn.cross_entropy"(%[[A32]], %arg1) : (tensor<8x16xf32>, tensor<8xi64>) -> tensor<f32>
// CHECK-NEXT: "dnn.add"(%[[L]], %[[S]]) : (tensor<f32>, tensor<f32>) -> tensor<f32>

// The weight's two uses: their gradients are cast to f32 and summed there.
// GRAD: "dnn.add"({{.*}}) : (tensor<16x16xf32>, tensor<16x16xf32>) -> tensor<16x16xf32>
// GRAD: return {{.*}} : tensor<f32>, tensor<16x16xf32>, tensor<16xf32>

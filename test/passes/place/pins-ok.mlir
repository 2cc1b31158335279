// A pin (nns.stage on an op) is kept by --place.
// RUN: nnscaler-opt --place="stages=2" %s 2>/dev/null | FileCheck %s

// The cheap relu pinned to stage 1 pulls the rest after it onto stage 1 too.
// CHECK: "dnn.linear"({{.*}}) {nns.stage = 0 : i64}
// CHECK-NEXT: "dnn.relu"({{.*}}) {nns.stage = 1 : i64}
// CHECK-NEXT: "dnn.linear"({{.*}}) {nns.stage = 1 : i64}
func.func @f(%x: tensor<8x32xf32>, %w1: tensor<32x32xf32>, %w2: tensor<4x32xf32>) -> tensor<8x4xf32> {
  %h = "dnn.linear"(%x, %w1) : (tensor<8x32xf32>, tensor<32x32xf32>) -> tensor<8x32xf32>
  %a = "dnn.relu"(%h) {nns.stage = 1} : (tensor<8x32xf32>) -> tensor<8x32xf32>
  %l = "dnn.linear"(%a, %w2) : (tensor<8x32xf32>, tensor<4x32xf32>) -> tensor<8x4xf32>
  return %l : tensor<8x4xf32>
}


// RUN: nnscaler-opt --split-tensor --split-input-file --verify-diagnostics %s

// A function with no layout at all gets them from --propagate-layouts first; one that has
// some but not all was edited after propagation, which is an error.
"nns.mesh"() {sym_name = "world", axes = #nns.axes<tp = 2>} : () -> ()
// expected-remark@+1 {{split-tensor: @f has no layouts; running --propagate-layouts first}}
func.func @f(%x: tensor<4x4xf32>) -> tensor<4x4xf32> {
  %0 = "dnn.exp"(%x) : (tensor<4x4xf32>) -> tensor<4x4xf32>
  return %0 : tensor<4x4xf32>
}

// -----

"nns.mesh"() {sym_name = "world", axes = #nns.axes<tp = 2>} : () -> ()
func.func @f2(%x: tensor<4x4xf32>) -> tensor<4x4xf32> {
  %0 = "dnn.exp"(%x) {nns.layouts = [#nns.layout<@world>]} : (tensor<4x4xf32>) -> tensor<4x4xf32>
  // expected-error@+1 {{split-tensor: 'dnn.exp': has no layouts; run --propagate-layouts first}}
  %1 = "dnn.exp"(%0) : (tensor<4x4xf32>) -> tensor<4x4xf32>
  return %1 : tensor<4x4xf32>
}

// -----

// Invalid directives are the verifier's: a frozen id, a factor that does not divide.
"nns.mesh"() {sym_name = "world", axes = #nns.axes<tp = 4>} : () -> ()
func.func @g(%x: tensor<6x4xf32>) -> tensor<6x4xf32> {
  // expected-error@+1 {{'dnn.softmax' nns.split: dimension 'b' is frozen}}
  %0 = "dnn.softmax"(%x) {nns.split = #nns.split<b = tp>} : (tensor<6x4xf32>) -> tensor<6x4xf32>
  // expected-error@+1 {{'dnn.exp' nns.split: dimension '*0' (result 0 dim 0) has length 6, which tp (size 4) does not divide}}
  %1 = "dnn.exp"(%0) {nns.split = #nns.split<*0 = tp>} : (tensor<6x4xf32>) -> tensor<6x4xf32>
  return %1 : tensor<6x4xf32>
}

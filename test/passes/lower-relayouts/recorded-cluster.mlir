// RUN: nnscaler-opt --lower-relayouts %s | FileCheck %s --check-prefix=CPU
// RUN: nnscaler-opt --lower-relayouts=cluster=dgx-h100 %s | FileCheck %s --check-prefix=H100
// RUN: sed 's/nns.cluster = "cpu"/nns.cluster = "nope"/' %s > %t.nope.mlir
// RUN: %not nnscaler-opt --lower-relayouts %t.nope.mlir -o %t.out 2>&1 | FileCheck %s --check-prefix=BAD
// RUN: test ! -e %t.out

// Without cluster=, the relayouts are priced on the cluster the module records
// (`nns.cluster`, which --plan="tp-search cluster=..." writes), so that they become the
// collectives the plan priced; cluster= overrides it. The partial sum of cluster.mlir:
// on the cpu preset reduce_scatters and all_gathers, on H100s one all_reduce.
// CPU: module attributes {nns.cluster = "cpu"}
// CPU-LABEL: func.func @partial_sum
// CPU: "nns.reduce_scatter"(%arg0) {axes = ["dp"], dim = 1
// CPU-NEXT: "nns.reduce_scatter"(%{{.*}}) {axes = ["tp"], dim = 1
// CPU-NEXT: "nns.all_gather"(%{{.*}}) {axes = ["tp"], dim = 1
// CPU-NEXT: "nns.all_gather"(%{{.*}}) {axes = ["dp"], dim = 1
// CPU-NEXT: return
// H100-LABEL: func.func @partial_sum
// H100: "nns.all_reduce"(%arg0) {axes = ["dp", "tp"]
// H100-NEXT: return
// A recorded cluster that cannot be read is named, with what to do; exit 1, no output.
// BAD: error: lower-relayouts: the cluster the plan was made for ('nns.cluster' = "nope"): {{.*}}nope{{.*}}; give --lower-relayouts=cluster=PRESET|FILE
module attributes {nns.cluster = "cpu"} {
  "nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
  func.func @partial_sum(%v: tensor<1024x1024xf32> {nns.layout = #nns.layout<@world, dp = V(sum), tp = V(sum)>}) -> tensor<1024x1024xf32> {
    %0 = "nns.relayout"(%v) {to = #nns.layout<@world>} : (tensor<1024x1024xf32>) -> tensor<1024x1024xf32>
    return %0 : tensor<1024x1024xf32>
  }
}

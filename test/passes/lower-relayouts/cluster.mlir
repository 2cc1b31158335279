// RUN: nnscaler-opt --lower-relayouts %s | FileCheck %s --check-prefix=BYTES
// RUN: nnscaler-opt --lower-relayouts=cluster=dgx-h100 %s | FileCheck %s --check-prefix=H100
// RUN: nnscaler-opt --lower-relayouts=cluster=cpu %s | FileCheck %s --check-prefix=CPU
// RUN: %not nnscaler-opt --lower-relayouts=cluster=nope %s 2>&1 | FileCheck %s --check-prefix=BAD

// With cluster=, each relayout takes the collectives the cost model predicts fastest on
// that cluster (what --plan=tp-search and auto assume), not the fewest bytes.

// A 4 MiB partial sum over dp x tp made whole: by bytes, a reduce_scatter over tp, an
// all_reduce of the pieces over dp and an all_gather (3/4 of the bytes of one ring over
// all eight). On 8 H100s (NVLink, NCCL's all_reduce through NVLink SHARP): one
// all_reduce. On the CPU runtime's in-process collectives (rings only, a copy's latency
// a step): reduce_scatters down to an eighth, gathered back.
// BYTES-LABEL: func.func @partial_sum
// BYTES: "nns.reduce_scatter"(%arg0) {axes = ["tp"], dim = 1
// BYTES-NEXT: "nns.all_reduce"(%{{.*}}) {axes = ["dp"]
// BYTES-NEXT: "nns.all_gather"(%{{.*}}) {axes = ["tp"], dim = 1
// H100-LABEL: func.func @partial_sum
// H100: "nns.all_reduce"(%arg0) {axes = ["dp", "tp"]
// H100-NEXT: return
// CPU-LABEL: func.func @partial_sum
// CPU: "nns.reduce_scatter"(%arg0) {axes = ["dp"], dim = 1
// CPU-NEXT: "nns.reduce_scatter"(%{{.*}}) {axes = ["tp"], dim = 1
// CPU-NEXT: "nns.all_gather"(%{{.*}}) {axes = ["tp"], dim = 1
// CPU-NEXT: "nns.all_gather"(%{{.*}}) {axes = ["dp"], dim = 1
// CPU-NEXT: return
"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2, tp = 4>} : () -> ()
func.func @partial_sum(%v: tensor<1024x1024xf32> {nns.layout = #nns.layout<@world, dp = V(sum), tp = V(sum)>}) -> tensor<1024x1024xf32> {
  %0 = "nns.relayout"(%v) {to = #nns.layout<@world>} : (tensor<1024x1024xf32>) -> tensor<1024x1024xf32>
  return %0 : tensor<1024x1024xf32>
}

// Rows split over tp to rows split over dp: by bytes an all_to_all (a quarter of an
// all_gather's bytes), a slice and an all_gather; on H100s, where a collective's latency
// outweighs those bytes, the all_gather and the slice.
// BYTES-LABEL: func.func @rows
// BYTES: "nns.all_to_all"
// BYTES-NEXT: "nns.slice"
// BYTES-NEXT: "nns.all_gather"
// H100-LABEL: func.func @rows
// H100: "nns.all_gather"(%arg0) {axes = ["tp"], dim = 0
// H100-NEXT: "nns.slice"(%{{.*}}) {axes = ["dp"], dim = 0
// H100-NEXT: return
func.func @rows(%d: tensor<1024x1024xf32> {nns.layout = #nns.layout<@world, tp = D(0)>}) -> tensor<1024x1024xf32> {
  %0 = "nns.relayout"(%d) {to = #nns.layout<@world, dp = D(0)>} : (tensor<1024x1024xf32>) -> tensor<1024x1024xf32>
  return %0 : tensor<1024x1024xf32>
}

// BAD: error: lower-relayouts: cluster 'nope': not a preset (dgx-a100, dgx-h100, h200, cpu) and not a readable file

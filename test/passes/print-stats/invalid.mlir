// RUN: %not nnscaler-opt --print-stats="func=nope" %s 2>&1 | FileCheck %s
// RUN: %not nnscaler-opt --print-stats="bogus=1" %s 2>&1 | FileCheck %s --check-prefix=OPT
// CHECK: error: print-stats: no function named '@nope'
// OPT: error: pass 'print-stats' has no option 'bogus' (options: func, cluster)
func.func @train() {
  return
}

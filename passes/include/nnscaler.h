/*
 * nnscaler's C API: nnscaler's passes in a C or C++ host's own MLIR pass manager.
 *
 * The host owns the MlirContext, the module and the pass manager (MLIR 19's C API,
 * mlir-c/IR.h and mlir-c/Pass.h). nnscaler's passes run on the host's IR in place: nothing
 * is printed, re-parsed or replaced, so the host's handles to ops a pass does not erase stay
 * valid. The `dnn` and `nns` dialects are checked by nnscaler's verifier (their ops are
 * unregistered MLIR ops written in generic form), so the context must allow unregistered
 * dialects: nnscalerPrepareContext does that.
 *
 * Errors are reported through MLIR's diagnostics (attach a handler with
 * mlirContextAttachDiagnosticHandler) and the pass manager's run fails; functions here that
 * can fail return an MlirLogicalResult and, on failure, pass a message to `onError`.
 *
 * The symbols are defined by the nnscaler-passes Rust library; a host links it together
 * with the MLIR 19 static libraries it was built against (one copy of MLIR per process).
 */
#ifndef NNSCALER_H
#define NNSCALER_H

#include "mlir-c/IR.h"
#include "mlir-c/Pass.h"
#include "mlir-c/Support.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Prepares `context` for nnscaler IR: allows unregistered dialects (the generic-form `dnn`
 * and `nns` ops) and loads the `func` and `arith` dialects nnscaler's passes create ops of. */
void nnscalerPrepareContext(MlirContext context);

/* Adds the passes of a textual pipeline to `pm`, a pass manager on `builtin.module`:
 * "autodiff,plan{policy=dp-megatron dp=2 tp=2},func.func(propagate-layouts,split-tensor)"
 * or the same wrapped in "builtin.module(...)". Pass options are written as in MLIR's
 * textual pipelines. Function passes are nested on `func.func` (MLIR runs them per
 * function), module passes (plan, print-stats) and the upstream cse / canonicalize are added
 * at module level. An unknown pass or option fails and calls `onError` with the reason; no
 * pass is added then. */
MlirLogicalResult nnscalerAddPasses(MlirOpPassManager pm, MlirStringRef pipeline,
                                    MlirStringCallback onError, void *userData);

/* Runs nnscaler's verifier (the dnn/nns ops against their specs, nns attributes against the
 * module's meshes) on `module`. Each problem is passed to `onError` as one line,
 * "file:line:col: error: message"; the result fails if there was any. */
MlirLogicalResult nnscalerVerify(MlirOperation module, MlirStringCallback onError,
                                 void *userData);

/* Calls `callback` once per registered pass with "name: summary". */
void nnscalerListPasses(MlirStringCallback callback, void *userData);

#ifdef __cplusplus
}
#endif

#endif /* NNSCALER_H */

/*
 * A small C host of nnscaler's C API (passes/include/nnscaler.h), run by the lit tests
 * (test/capi/): it owns an MLIR context, parses a module, keeps a handle to the module's first
 * op, runs a textual pipeline of nnscaler (and upstream) passes in its own MLIR pass manager,
 * prints the module, and checks the kept handle afterwards.
 *
 *   nnscaler-c-host FILE.mlir PIPELINE
 *
 * Exit status 0 on success, 1 on any failure (diagnostics on stderr). The process entry is
 * the nnscaler-c-host binary, which calls nnscaler_c_host_main: cargo links this file with
 * the Rust library that defines the nnscaler* functions and the MLIR static libraries, so
 * the process holds one copy of MLIR.
 */
#include "nnscaler.h"

#include "mlir-c/Diagnostics.h"
#include "mlir-c/IR.h"
#include "mlir-c/Pass.h"
#include "mlir-c/RegisterEverything.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void print_to(MlirStringRef s, void *stream) {
  fwrite(s.data, 1, s.length, (FILE *)stream);
}

static MlirLogicalResult on_diagnostic(MlirDiagnostic d, void *user) {
  (void)user;
  mlirLocationPrint(mlirDiagnosticGetLocation(d), print_to, stderr);
  fputs(": ", stderr);
  switch (mlirDiagnosticGetSeverity(d)) {
  case MlirDiagnosticError: fputs("error: ", stderr); break;
  case MlirDiagnosticWarning: fputs("warning: ", stderr); break;
  case MlirDiagnosticNote: fputs("note: ", stderr); break;
  case MlirDiagnosticRemark: fputs("remark: ", stderr); break;
  }
  mlirDiagnosticPrint(d, print_to, stderr);
  fputc('\n', stderr);
  return mlirLogicalResultSuccess();
}

static void on_error(MlirStringRef s, void *what) {
  fprintf(stderr, "nnscaler-c-host: %s: ", (const char *)what);
  fwrite(s.data, 1, s.length, stderr);
  fputc('\n', stderr);
}

static char *read_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 1 << 16, len = 0, n;
  char *buf = malloc(cap);
  while (buf && (n = fread(buf + len, 1, cap - len - 1, f)) > 0) {
    len += n;
    if (len + 1 == cap) {
      char *more = realloc(buf, cap *= 2);
      if (!more) { free(buf); buf = NULL; }
      else buf = more;
    }
  }
  fclose(f);
  if (buf) buf[len] = '\0';
  return buf;
}

int nnscaler_c_host_main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: nnscaler-c-host FILE.mlir PIPELINE\n");
    return 1;
  }
  char *source = read_file(argv[1]);
  if (!source) {
    fprintf(stderr, "nnscaler-c-host: cannot read '%s'\n", argv[1]);
    return 1;
  }
  MlirContext ctx = mlirContextCreate();
  MlirDialectRegistry registry = mlirDialectRegistryCreate();
  mlirRegisterAllDialects(registry);
  mlirContextAppendDialectRegistry(ctx, registry);
  mlirDialectRegistryDestroy(registry);
  nnscalerPrepareContext(ctx);
  mlirContextAttachDiagnosticHandler(ctx, on_diagnostic, NULL, NULL);

  int status = 1;
  MlirModule module = mlirModuleCreateParse(ctx, mlirStringRefCreateFromCString(source));
  free(source);
  if (mlirModuleIsNull(module)) goto done_ctx;
  MlirOperation op = mlirModuleGetOperation(module);
  if (mlirLogicalResultIsFailure(nnscalerVerify(op, on_error, "verify"))) goto done_module;

  /* A handle the host keeps across the passes: the module's first op. */
  MlirOperation kept = mlirBlockGetFirstOperation(mlirModuleGetBody(module));

  MlirPassManager pm = mlirPassManagerCreate(ctx);
  MlirOpPassManager top = mlirPassManagerGetAsOpPassManager(pm);
  if (mlirLogicalResultIsFailure(
          nnscalerAddPasses(top, mlirStringRefCreateFromCString(argv[2]), on_error, "pipeline")))
    goto done_pm;
  if (mlirLogicalResultIsFailure(mlirPassManagerRunOnOp(pm, op))) {
    fprintf(stderr, "nnscaler-c-host: the pass pipeline failed\n");
    goto done_pm;
  }
  mlirOperationPrint(op, print_to, stdout);
  fputc('\n', stdout);
  if (!mlirOperationIsNull(kept)) {
    fputs("kept handle: ", stderr);
    MlirIdentifier name = mlirOperationGetName(kept);
    print_to(mlirIdentifierStr(name), stderr);
    MlirAttribute sym = mlirOperationGetAttributeByName(kept, mlirStringRefCreateFromCString("sym_name"));
    if (!mlirAttributeIsNull(sym)) {
      fputs(" ", stderr);
      mlirAttributePrint(sym, print_to, stderr);
    }
    fputc('\n', stderr);
  }
  status = 0;
done_pm:
  mlirPassManagerDestroy(pm);
done_module:
  mlirModuleDestroy(module);
done_ctx:
  mlirContextDestroy(ctx);
  return status;
}

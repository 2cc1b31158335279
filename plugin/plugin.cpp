//===- plugin.cpp - nnscaler's passes as an mlir-opt-19 pass plugin -------===//
//
// mlir-opt-19 --load-pass-plugin=libnnscaler_plugin.so \
//   --pass-pipeline='builtin.module(autodiff,plan{dp dp=2},...)' in.mlir
//
// One MLIR pass per nnscaler pass (names, summaries and anchors from the Rust registry).
// Options are checked when the pipeline is parsed (a bad one is a pipeline error) and
// handed to the Rust pass as text; the Rust side runs the pass on the op in place, emits
// its errors as MLIR diagnostics and passes its remarks back, which are emitted here. See
// docs/architecture.md (the plugin crate) and plugin/build-so.sh for how it is linked
// (no second copy of MLIR).
//
//===----------------------------------------------------------------------===//

#include "mlir/CAPI/IR.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/Pass/Pass.h"
#include "mlir/Pass/PassRegistry.h"
#include "mlir/Tools/Plugins/PassPlugin.h"
#include "mlir-c/IR.h"
#include "mlir-c/Support.h"

#include <memory>
#include <string>

extern "C" {
size_t nnscalerPluginPassCount(void);
bool nnscalerPluginPassInfo(size_t i, MlirStringRef *name, MlirStringRef *summary,
                            MlirStringRef *anchor);
MlirLogicalResult nnscalerPluginCheckOptions(size_t i, MlirStringRef options,
                                             MlirStringCallback onError, void *userData);
MlirLogicalResult nnscalerPluginRun(size_t i, MlirStringRef options, MlirOperation op,
                                    void (*onRemark)(MlirLocation, MlirStringRef, void *),
                                    void *userData);
}

namespace {

// One distinct address per pass: MLIR tells pass kinds apart by TypeID.
char passIds[64];

llvm::StringRef str(MlirStringRef s) { return llvm::StringRef(s.data, s.length); }

void appendTo(MlirStringRef s, void *out) {
  static_cast<std::string *>(out)->append(s.data, s.length);
}

void emitRemark(MlirLocation loc, MlirStringRef message, void *) {
  mlir::emitRemark(unwrap(loc)) << str(message);
}

class NnscalerPass : public mlir::Pass {
public:
  NnscalerPass(size_t index, llvm::StringRef name, llvm::StringRef summary,
               llvm::StringRef anchor)
      : mlir::Pass(mlir::TypeID::getFromOpaquePointer(&passIds[index]), anchor),
        index(index), name(name), summary(summary), anchor(anchor) {}
  NnscalerPass(const NnscalerPass &other) = default;

  llvm::StringRef getName() const override { return name; }
  llvm::StringRef getArgument() const override { return name; }
  llvm::StringRef getDescription() const override { return summary; }

  mlir::LogicalResult initializeOptions(
      llvm::StringRef text,
      llvm::function_ref<mlir::LogicalResult(const llvm::Twine &)> errorHandler) override {
    std::string error;
    MlirStringRef s = mlirStringRefCreate(text.data(), text.size());
    if (mlirLogicalResultIsFailure(nnscalerPluginCheckOptions(index, s, appendTo, &error)))
      return errorHandler(error);
    options = text.str();
    return mlir::success();
  }

  bool canScheduleOn(mlir::RegisteredOperationName op) const override {
    return op.getStringRef() == anchor;
  }

  std::unique_ptr<mlir::Pass> clonePass() const override {
    return std::make_unique<NnscalerPass>(*this);
  }

  void runOnOperation() override {
    MlirStringRef s = mlirStringRefCreate(options.data(), options.size());
    if (mlirLogicalResultIsFailure(
            nnscalerPluginRun(index, s, wrap(getOperation()), emitRemark, nullptr)))
      signalPassFailure();
  }

private:
  size_t index;
  llvm::StringRef name, summary, anchor; // static strings of the Rust registry
  std::string options;
};

void registerNnscalerPasses() {
  size_t n = nnscalerPluginPassCount();
  for (size_t i = 0; i < n && i < sizeof(passIds); ++i) {
    MlirStringRef name, summary, anchor;
    if (!nnscalerPluginPassInfo(i, &name, &summary, &anchor))
      continue;
    mlir::registerPass([=]() -> std::unique_ptr<mlir::Pass> {
      return std::make_unique<NnscalerPass>(i, str(name), str(summary), str(anchor));
    });
  }
}

} // namespace

extern "C" LLVM_ATTRIBUTE_WEAK mlir::PassPluginLibraryInfo mlirGetPassPluginInfo() {
  return {MLIR_PLUGIN_API_VERSION, "nnscaler", "0.1", registerNnscalerPasses};
}

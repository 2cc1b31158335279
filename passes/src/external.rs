//! Our passes as MLIR external passes, for any melior host's `PassManager`.
//!
//! `mlir_pass("autodiff", "")` returns a `melior::pass::Pass` on `builtin.module` that runs
//! the registered pass of that name: it prints the module (with locations), runs the pass
//! in a private context through the same runner `nnscaler-opt` uses (the IR is verified
//! afterwards), and re-parses the result into the host's context, replacing the module's
//! body. Errors are emitted on the module's location (with the file:line:col of the
//! problem in the message) and fail the pass manager. The host context must allow
//! unregistered dialects (`dnn`/`nns` ops are unregistered MLIR ops).

use crate::pipeline::{self, Step};
use crate::registry::{Factory, PASSES};
use melior::ir::r#type::TypeId;
use melior::ir::OperationRef;
use melior::pass::{create_external, ExternalPass, RunExternalPass};
use melior::ContextRef;
use mlir_sys::{
    mlirBlockAppendOwnedOperation, mlirBlockGetFirstOperation, mlirEmitError,
    mlirOperationCreateParse, mlirOperationDestroy, mlirOperationGetRegion,
    mlirOperationRemoveFromParent, mlirRegionGetFirstBlock, mlirStringRefCreateFromCString,
};
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::view::op_text_with_locs;
use std::ffi::CString;

/// One distinct address per registered pass: MLIR identifies pass kinds by `TypeId`.
#[repr(align(8))]
#[derive(Debug)]
struct PassId(#[allow(dead_code)] u8);

static IDS: [PassId; 16] = [const { PassId(0) }; 16];

#[derive(Clone, Debug)]
struct External {
    step: Step,
}

impl<'c> RunExternalPass<'c> for External {
    fn initialize(&mut self, _context: ContextRef<'c>) {}

    fn run(&mut self, operation: OperationRef<'c, '_>, pass: ExternalPass<'_>) {
        if let Err(msg) = run_via_text(&self.step, &operation) {
            let text = CString::new(format!("nnscaler {}: {msg}", self.step.info.name))
                .unwrap_or_default();
            // SAFETY: the location belongs to the live operation; the message is a C string.
            unsafe { mlirEmitError(operation.location().to_raw(), text.as_ptr()) };
            pass.signal_failure();
        }
    }
}

/// The registered pass `name` with options `options` (`key=value ...`) as an MLIR pass.
/// Upstream passes (`cse`, `canonicalize`) are returned as themselves.
pub fn mlir_pass(name: &str, options: &str) -> Result<melior::pass::Pass, String> {
    let step = Step::new(name, options)?;
    if let Factory::Upstream(make) = step.info.factory {
        return Ok(make());
    }
    let index = PASSES.iter().position(|p| p.name == name).unwrap_or(0);
    let id = IDS
        .get(index)
        .ok_or("too many passes for the external-pass id table")?;
    let info = step.info;
    Ok(create_external(
        External { step },
        TypeId::create(id),
        info.name,
        info.name,
        info.summary,
        "builtin.module",
        &[],
    ))
}

fn run_via_text(step: &Step, module: &OperationRef<'_, '_>) -> Result<(), String> {
    let text = op_text_with_locs(module);
    let ir = IrContext::new();
    let mut m = ir.parse(&text, "<nnscaler>").map_err(|d| d.to_string())?;
    pipeline::run(
        &ir,
        &mut m,
        std::slice::from_ref(step),
        &mut |_, _| {},
        "<nnscaler>",
    )
    .map_err(|d| d.to_string())?;
    let out = op_text_with_locs(&m.as_operation());
    let src = CString::new(out).map_err(|_| "the printed module contains a NUL byte")?;
    let name = CString::new("<nnscaler>").unwrap_or_default();
    // SAFETY: every handle below is either the live module the pass manager gave us, or an
    // operation we parsed and own; ops are detached before they are moved or destroyed.
    unsafe {
        let ctx = module.context().to_ref().to_raw();
        let parsed = mlirOperationCreateParse(
            ctx,
            mlirStringRefCreateFromCString(src.as_ptr()),
            mlirStringRefCreateFromCString(name.as_ptr()),
        );
        if parsed.ptr.is_null() {
            return Err("the transformed module does not parse in the host context (does it allow unregistered dialects?)".into());
        }
        let host = mlirRegionGetFirstBlock(mlirOperationGetRegion(module.to_raw(), 0));
        loop {
            let op = mlirBlockGetFirstOperation(host);
            if op.ptr.is_null() {
                break;
            }
            mlirOperationDestroy(op);
        }
        let body = mlirRegionGetFirstBlock(mlirOperationGetRegion(parsed, 0));
        loop {
            let op = mlirBlockGetFirstOperation(body);
            if op.ptr.is_null() {
                break;
            }
            mlirOperationRemoveFromParent(op);
            mlirBlockAppendOwnedOperation(host, op);
        }
        mlirOperationDestroy(parsed);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use melior::dialect::DialectRegistry;
    use melior::ir::Module;
    use melior::pass::PassManager;
    use melior::utility::register_all_dialects;
    use melior::Context;

    const SRC: &str = r#"module {
  func.func @train(%x: tensor<4x3xf32> {nns.name = "x"}, %w: tensor<2x3xf32> {nns.name = "w", nns.param}) -> (tensor<f32> {nns.name = "loss"}) {
    %y = "dnn.linear"(%x, %w) : (tensor<4x3xf32>, tensor<2x3xf32>) -> tensor<4x2xf32>
    %l = "dnn.mean"(%y) {dims = array<i64: 0, 1>} : (tensor<4x2xf32>) -> tensor<f32>
    return %l : tensor<f32>
  }
}"#;

    fn host() -> Context {
        let registry = DialectRegistry::new();
        register_all_dialects(&registry);
        let context = Context::new();
        context.append_dialect_registry(&registry);
        context.load_all_available_dialects();
        context.set_allow_unregistered_dialects(true);
        context
    }

    #[test]
    fn runs_in_a_melior_pass_manager_with_upstream_passes() {
        let context = host();
        let mut module = Module::parse(&context, SRC).expect("parses");
        let pm = PassManager::new(&context);
        pm.add_pass(mlir_pass("autodiff", "").unwrap());
        pm.add_pass(mlir_pass("cse", "").unwrap());
        pm.add_pass(mlir_pass("plan", "dp dp=2").unwrap());
        pm.add_pass(mlir_pass("propagate-layouts", "").unwrap());
        pm.add_pass(mlir_pass("split-tensor", "").unwrap());
        pm.add_pass(mlir_pass("lower-relayouts", "").unwrap());
        pm.run(&mut module).expect("the pipeline succeeds");
        let text = module.as_operation().to_string();
        assert!(text.contains("grad.w"), "{text}");
        assert!(text.contains("\"nns.all_reduce\""), "{text}");
        assert!(module.as_operation().verify());
    }

    #[test]
    fn errors_fail_the_pass_manager() {
        let context = host();
        let mut module = Module::parse(&context, SRC).expect("parses");
        let pm = PassManager::new(&context);
        pm.add_pass(mlir_pass("propagate-layouts", "").unwrap());
        assert!(pm.run(&mut module).is_err(), "no mesh: the pass must fail");
        assert!(mlir_pass("nope", "").is_err());
    }
}

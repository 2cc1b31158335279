//! Our passes as MLIR external passes, for any melior host's `PassManager`.
//!
//! `mlir_pass("propagate-layouts", "")` returns a `melior::pass::Pass` that runs the
//! registered pass of that name on the host's own IR, in place: a function pass is anchored
//! on `func.func` and must be added to a pass manager nested on `func.func`
//! (`pm.nested_under("func.func").add_pass(..)`; MLIR aborts the process when an anchored
//! pass is added at the wrong level), a module pass on `builtin.module`.
//! [`add_to_pass_manager`] picks the level. Nothing is printed or
//! re-parsed and nothing replaces the host's module body, so the host's handles to ops the
//! pass does not erase stay valid. After the pass, our dialect verifier checks what it
//! changed (the function, or the module); MLIR's verifier runs as the pass manager
//! verifies. Errors are emitted as MLIR diagnostics at their own locations, naming the pass
//! and the function, and fail the pass manager. The host context must allow unregistered
//! dialects (`dnn`/`nns` ops are unregistered MLIR ops).

use crate::pass::Native;
use crate::pass::{Anchor, Factory};
use crate::pipeline::Step;
use crate::registry::PASSES;
use melior::ir::r#type::TypeId;
use melior::ir::OperationRef;
use melior::pass::{create_external, ExternalPass, OperationPassManager, RunExternalPass};
use melior::ContextRef;
use mlir_sys::{mlirEmitError, mlirOperationGetLocation};
use nnscaler_dialects::diag::{Diagnostics, Severity};
use nnscaler_dialects::verify::{verify_function, verify_module_op};
use std::ffi::CString;

/// One distinct address per registered pass: MLIR identifies pass kinds by `TypeId`.
#[repr(align(8))]
#[derive(Debug)]
struct PassId(#[allow(dead_code)] u8);

static IDS: [PassId; 32] = [const { PassId(0) }; 32];

#[derive(Clone, Debug)]
struct External {
    step: Step,
}

impl<'c> RunExternalPass<'c> for External {
    fn initialize(&mut self, _context: ContextRef<'c>) {}

    fn run(&mut self, operation: OperationRef<'c, '_>, pass: ExternalPass<'_>) {
        // Remarks have no route into a host's diagnostics through MLIR 19's C API (it emits
        // errors only); nnscaler-opt and the mlir-opt plugin show them.
        if let Err(d) = run_in_place(&self.step, &operation) {
            emit(&d, &operation, self.step.info.name);
            pass.signal_failure();
        }
    }
}

/// The registered pass `name` with options `options` (`key=value ...`) as an MLIR pass,
/// anchored as the registry says (`func.func` for function passes, `builtin.module` for
/// module passes). Upstream passes (`cse`, `canonicalize`) are returned as themselves.
pub fn mlir_pass(name: &str, options: &str) -> Result<melior::pass::Pass, String> {
    let step = crate::registry::step(name, options)?;
    if let Factory::Upstream(make) = step.info.factory {
        return Ok(make());
    }
    let index = PASSES.iter().position(|p| p.name == name).unwrap_or(0);
    let id = IDS
        .get(index)
        .ok_or("too many passes for the external-pass id table")?;
    let info = step.info;
    let anchor = match info.anchor {
        Anchor::Module => "builtin.module",
        Anchor::Function => "func.func",
    };
    Ok(create_external(
        External { step },
        TypeId::create(id),
        info.name,
        info.name,
        info.summary,
        anchor,
        &[],
    ))
}

/// Adds the registered pass `name` to `pm`, a pass manager on `builtin.module`: a function
/// pass is nested under `func.func` (so MLIR runs it on each function), a module pass is
/// added directly.
pub fn add_to_pass_manager(
    pm: &OperationPassManager<'_, '_>,
    name: &str,
    options: &str,
) -> Result<(), String> {
    let info = crate::registry::lookup(name).ok_or(format!(
        "unknown pass '{name}' (see nnscaler-opt --list-passes)"
    ))?;
    let pass = mlir_pass(name, options)?;
    match (info.anchor, info.factory) {
        (Anchor::Function, Factory::Native(_)) => pm.nested_under("func.func").add_pass(pass),
        _ => pm.add_pass(pass),
    }
    Ok(())
}

/// Runs `step` on `op` (a module or a function, by the pass's anchor) in place, then
/// verifies what it changed. Returns the pass's remarks. (What the external pass, the C API
/// and the mlir-opt plugin run.)
pub fn run_in_place(step: &Step, op: &OperationRef<'_, '_>) -> Result<Diagnostics, Diagnostics> {
    let Factory::Native(make) = step.info.factory else {
        return Ok(Diagnostics::default());
    };
    let mut native = make(&step.options).map_err(|e| {
        let mut d = Diagnostics::default();
        d.error(&Default::default(), e);
        d
    })?;
    let is_func = op.name().as_string_ref().as_str() == Ok("func.func");
    let remarks = match (&mut native, is_func) {
        (Native::Function(p), true) => crate::rewrite::run_on_function(p.as_mut(), op)?,
        (_, false) => native.run(op)?,
        (Native::Module(_), true) => {
            let mut d = Diagnostics::default();
            d.error(
                &Default::default(),
                "works on the whole module; add it outside func.func",
            );
            return Err(d);
        }
    };
    let d = if is_func {
        verify_function(op)
    } else {
        verify_module_op(op)
    };
    if d.has_errors() {
        return Err(d);
    }
    Ok(remarks)
}

/// Emits the errors of `d` as MLIR diagnostics: each at its own location when it has one,
/// else at `op`'s, naming the pass and (for a function) the function.
pub fn emit(d: &Diagnostics, op: &OperationRef<'_, '_>, pass: &str) {
    let func = if op.name().as_string_ref().as_str() == Ok("func.func") {
        op.attribute("sym_name")
            .ok()
            .and_then(|a| melior::ir::attribute::StringAttribute::try_from(a).ok())
            .map(|s| format!(" @{}", s.value()))
            .unwrap_or_default()
    } else {
        String::new()
    };
    for x in &d.0 {
        if x.severity != Severity::Error {
            continue;
        }
        let message = x
            .message
            .strip_prefix(pass)
            .and_then(|m| m.strip_prefix(": "))
            .unwrap_or(&x.message);
        let text = CString::new(format!("nnscaler {pass}{func}: {message}")).unwrap_or_default();
        // SAFETY: locations are uniqued in the op's context, which is alive; the message is
        // a C string.
        unsafe {
            let loc = match &x.loc.raw {
                Some(raw) => raw.0,
                None => mlirOperationGetLocation(op.to_raw()),
            };
            mlirEmitError(loc, text.as_ptr());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use melior::dialect::DialectRegistry;
    use melior::ir::{BlockLike, Module, RegionLike};
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
    fn every_pass_has_an_id() {
        assert!(
            PASSES.len() <= IDS.len(),
            "{} passes but {} external-pass ids: grow IDS",
            PASSES.len(),
            IDS.len()
        );
    }

    /// The host's pipeline: ours at their anchors, next to upstream ones.
    fn pipeline(pm: &PassManager<'_>) {
        let top = pm.as_operation_pass_manager();
        add_to_pass_manager(&top, "autodiff", "").unwrap();
        add_to_pass_manager(&top, "cse", "").unwrap();
        add_to_pass_manager(&top, "plan", "dp dp=2").unwrap();
        let funcs = pm.nested_under("func.func");
        funcs.add_pass(mlir_pass("propagate-layouts", "").unwrap());
        funcs.add_pass(mlir_pass("split-tensor", "").unwrap());
        funcs.add_pass(mlir_pass("lower-relayouts", "").unwrap());
    }

    #[test]
    fn runs_in_a_melior_pass_manager_with_upstream_passes() {
        let context = host();
        let mut module = Module::parse(&context, SRC).expect("parses");
        let pm = PassManager::new(&context);
        pipeline(&pm);
        pm.run(&mut module).expect("the pipeline succeeds");
        let text = module.as_operation().to_string();
        assert!(text.contains("grad.w"), "{text}");
        assert!(text.contains("\"nns.all_reduce\""), "{text}");
        assert!(module.as_operation().verify());
    }

    #[test]
    fn the_hosts_handles_survive_the_passes() {
        let context = host();
        let src = SRC.replace(
            "module {",
            "module {\n  func.func private @helper(%i: index) -> index {\n    return %i : index\n  }",
        );
        let mut module = Module::parse(&context, &src).expect("parses");
        // Raw handles the host keeps across the pipeline: a function the passes leave
        // alone, the function they rewrite, and an op inside it that they keep.
        let (helper, train, linear) = {
            let body = module.body();
            let first = body.first_operation().unwrap();
            let helper = first.to_raw();
            let train = first.next_in_block().unwrap();
            let linear = train
                .region(0)
                .unwrap()
                .first_block()
                .unwrap()
                .first_operation()
                .unwrap()
                .to_raw();
            (helper, train.to_raw(), linear)
        };
        let pm = PassManager::new(&context);
        pipeline(&pm);
        pm.run(&mut module).expect("the pipeline succeeds");
        // SAFETY: what is tested: the ops are still alive, in the same module.
        let (helper, train, linear) = unsafe {
            (
                OperationRef::from_raw(helper),
                OperationRef::from_raw(train),
                OperationRef::from_raw(linear),
            )
        };
        assert!(helper.to_string().contains("func.func private @helper"));
        assert!(
            train.to_string().contains("grad.w"),
            "the rewritten function"
        );
        let linear = linear.to_string();
        assert!(linear.starts_with("%0 = \"dnn.linear\""), "{linear}");
        assert!(
            linear.contains("nns.split"),
            "the kept op got its split: {linear}"
        );
    }

    #[test]
    fn errors_fail_the_pass_manager() {
        let context = host();
        let mut module = Module::parse(&context, SRC).expect("parses");
        let pm = PassManager::new(&context);
        add_to_pass_manager(&pm.as_operation_pass_manager(), "propagate-layouts", "").unwrap();
        assert!(pm.run(&mut module).is_err(), "no mesh: the pass must fail");
        assert!(mlir_pass("nope", "").is_err());
    }
}

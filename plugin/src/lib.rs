//! nnscaler's passes as an `mlir-opt-19` pass plugin: the Rust half.
//!
//! `plugin/plugin.cpp` registers one MLIR pass per native pass of the registry (same names
//! and anchors as nnscaler-opt: `func.func` for function passes, `builtin.module` for module
//! passes) and calls these functions to check options and to run a pass on the op MLIR gives
//! it, in place. `plugin/build-so.sh` links the plugin without a second copy of MLIR: only
//! this library's Rust objects and MLIR's C API archives go in; MLIR itself is resolved from
//! the `mlir-opt-19` process that loads the plugin (Debian's `mlir-opt-19` exports its C++
//! symbols). See `docs/architecture.md` (the `plugin` crate).

#![allow(non_snake_case)] // C names, as in MLIR's C API.

use melior::ir::OperationRef;
use mlir_sys::{
    mlirOperationGetLocation, MlirLocation, MlirLogicalResult, MlirOperation, MlirStringCallback,
    MlirStringRef,
};
use nnscaler_dialects::diag::Severity;
use nnscaler_passes::external::{emit, run_in_place};
use nnscaler_passes::pass::{Anchor, Factory, PassInfo, PassOptions};
use nnscaler_passes::registry::PASSES;
use std::ffi::c_void;

use nnscaler_passes::capi::{result, say, string_ref as sref, text};

/// Called with each remark: its location, its message.
pub type RemarkCallback = Option<unsafe extern "C" fn(MlirLocation, MlirStringRef, *mut c_void)>;

/// The passes the plugin registers: ours (upstream ones are mlir-opt's own).
fn native(i: usize) -> Option<&'static PassInfo> {
    PASSES
        .iter()
        .filter(|p| matches!(p.factory, Factory::Native(_)))
        .nth(i)
}

/// How many passes the plugin registers.
#[no_mangle]
pub extern "C" fn nnscalerPluginPassCount() -> usize {
    (0..).take_while(|&i| native(i).is_some()).count()
}

/// Pass `i`'s name, summary and anchor (`func.func` or `builtin.module`); false when there
/// is no pass `i`. The strings are static.
///
/// # Safety
/// The out-pointers must be writable.
#[no_mangle]
pub unsafe extern "C" fn nnscalerPluginPassInfo(
    i: usize,
    name: *mut MlirStringRef,
    summary: *mut MlirStringRef,
    anchor: *mut MlirStringRef,
) -> bool {
    let Some(p) = native(i) else { return false };
    let a = match p.anchor {
        Anchor::Function => "func.func",
        Anchor::Module => "builtin.module",
    };
    // SAFETY: the caller's contract.
    unsafe {
        *name = sref(p.name);
        *summary = sref(p.summary);
        *anchor = sref(a);
    }
    true
}

/// Checks pass `i`'s options (the text between `{}` in a textual pipeline); on failure
/// `on_error` gets the reason.
///
/// # Safety
/// `options` must be readable.
#[no_mangle]
pub unsafe extern "C" fn nnscalerPluginCheckOptions(
    i: usize,
    options: MlirStringRef,
    on_error: MlirStringCallback,
    user_data: *mut c_void,
) -> MlirLogicalResult {
    let Some(p) = native(i) else {
        return result(false);
    };
    // SAFETY: the caller's contract.
    let checked = unsafe { text(options) }.and_then(|options| PassOptions::parse(p, &options));
    let checked = checked.and_then(|o| match p.factory {
        Factory::Native(make) => make(&o).map(drop),
        Factory::Upstream(_) => Ok(()),
    });
    match checked {
        Ok(()) => result(true),
        Err(e) => {
            // SAFETY: the callback and data C++ gave.
            unsafe { say(on_error, user_data, &e) };
            result(false)
        }
    }
}

/// Runs pass `i` with `options` on `op` in place. Errors are emitted as MLIR diagnostics
/// (and the result fails); remarks go to `on_remark`.
///
/// # Safety
/// `op` must be a live operation of the pass's anchor; `options` readable.
#[no_mangle]
pub unsafe extern "C" fn nnscalerPluginRun(
    i: usize,
    options: MlirStringRef,
    op: MlirOperation,
    on_remark: RemarkCallback,
    user_data: *mut c_void,
) -> MlirLogicalResult {
    let Some(p) = native(i) else {
        return result(false);
    };
    // SAFETY: the caller's contract.
    let (options, op) = unsafe { (text(options), OperationRef::from_raw(op)) };
    let step = match options.and_then(|o| nnscaler_passes::registry::step(p.name, &o)) {
        Ok(s) => s,
        Err(e) => {
            let mut d = nnscaler_dialects::diag::Diagnostics::default();
            d.error(&Default::default(), e);
            emit(&d, &op, p.name);
            return result(false);
        }
    };
    match run_in_place(&step, &op) {
        Ok(remarks) => {
            if let Some(f) = on_remark {
                for r in remarks.0.iter().filter(|r| r.severity == Severity::Remark) {
                    let loc = match &r.loc.raw {
                        Some(raw) => raw.0,
                        // SAFETY: `op` is live.
                        None => unsafe { mlirOperationGetLocation(op.to_raw()) },
                    };
                    // SAFETY: the callback gets a location of the op's context and a
                    // string that lives for the call.
                    unsafe { f(loc, sref(&r.message), user_data) };
                }
            }
            result(true)
        }
        Err(d) => {
            emit(&d, &op, p.name);
            result(false)
        }
    }
}

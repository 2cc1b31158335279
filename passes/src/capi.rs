//! The C API (`passes/include/nnscaler.h`): our passes in a C or C++ host's pass manager.
//!
//! Each function is a thin wrapper over the Rust API ([`crate::external`],
//! [`crate::registry::parse_pipeline`], [`nnscaler_dialects::verify`]); the header documents
//! the contract. Strings cross as `MlirStringRef` (not NUL-terminated) and messages go
//! back through `MlirStringCallback`, as in MLIR's own C API.

#![allow(non_snake_case)] // C names follow MLIR's C API (`mlirPassManagerAddOwnedPass`).

use crate::external::add_to_pass_manager;
use crate::registry::PASSES;
use melior::ir::OperationRef;
use melior::pass::OperationPassManager;
use mlir_sys::{
    mlirContextGetOrLoadDialect, mlirContextSetAllowUnregisteredDialects, MlirContext,
    MlirLogicalResult, MlirOpPassManager, MlirOperation, MlirStringCallback, MlirStringRef,
};
use nnscaler_dialects::verify::verify_module_op;
use std::ffi::c_void;

/// `ok` as an `MlirLogicalResult`. (These helpers are shared with the mlir-opt plugin.)
pub fn result(ok: bool) -> MlirLogicalResult {
    MlirLogicalResult {
        value: i8::from(ok),
    }
}

/// `text` as an `MlirStringRef` (valid while `text` lives).
pub fn string_ref(text: &str) -> MlirStringRef {
    MlirStringRef {
        data: text.as_ptr().cast(),
        length: text.len(),
    }
}

/// Calls `callback` with `text` (when there is a callback).
///
/// # Safety
/// `callback` must be a valid function taking `user_data`, as the host gave them.
pub unsafe fn say(callback: MlirStringCallback, user_data: *mut c_void, text: &str) {
    if let Some(f) = callback {
        // SAFETY: the caller's contract; the string lives for the call, as in MLIR.
        unsafe { f(string_ref(text), user_data) };
    }
}

/// The string `s` holds.
///
/// # Safety
/// `s` must point at `length` readable bytes (or be empty).
pub unsafe fn text(s: MlirStringRef) -> Result<String, String> {
    if s.length == 0 {
        return Ok(String::new());
    }
    // SAFETY: by the caller's contract.
    let bytes = unsafe { std::slice::from_raw_parts(s.data.cast::<u8>(), s.length) };
    String::from_utf8(bytes.to_vec()).map_err(|_| "the text is not UTF-8".to_string())
}

/// See `nnscalerPrepareContext` in `nnscaler.h`.
///
/// # Safety
/// `context` must be a live MLIR context.
#[no_mangle]
pub unsafe extern "C" fn nnscalerPrepareContext(context: MlirContext) {
    // SAFETY: the context is live (the caller's contract); names are static strings.
    unsafe {
        mlirContextSetAllowUnregisteredDialects(context, true);
        for d in ["func", "arith"] {
            mlirContextGetOrLoadDialect(context, string_ref(d));
        }
    }
}

/// See `nnscalerAddPasses` in `nnscaler.h`.
///
/// # Safety
/// `pm` must be a live pass manager on `builtin.module`; `pipeline` a readable string.
#[no_mangle]
pub unsafe extern "C" fn nnscalerAddPasses(
    pm: MlirOpPassManager,
    pipeline: MlirStringRef,
    on_error: MlirStringCallback,
    user_data: *mut c_void,
) -> MlirLogicalResult {
    // SAFETY: by the caller's contract.
    let steps = unsafe { text(pipeline) }.and_then(|t| crate::registry::parse_pipeline(&t));
    let steps = match steps {
        Ok(s) => s,
        Err(e) => {
            // SAFETY: the host\'s callback and data, as it gave them.
            unsafe { say(on_error, user_data, &e) };
            return result(false);
        }
    };
    // SAFETY: `pm` is live (the caller's contract) and outlives this call.
    let pm = unsafe { OperationPassManager::from_raw(pm) };
    for step in &steps {
        let options: Vec<String> = step
            .options
            .0
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        if let Err(e) = add_to_pass_manager(&pm, step.info.name, &options.join(" ")) {
            // SAFETY: the host\'s callback and data, as it gave them.
            unsafe { say(on_error, user_data, &e) };
            return result(false);
        }
    }
    result(true)
}

/// See `nnscalerVerify` in `nnscaler.h`.
///
/// # Safety
/// `module` must be a live `builtin.module` op.
#[no_mangle]
pub unsafe extern "C" fn nnscalerVerify(
    module: MlirOperation,
    on_error: MlirStringCallback,
    user_data: *mut c_void,
) -> MlirLogicalResult {
    // SAFETY: by the caller's contract.
    let op = unsafe { OperationRef::from_raw(module) };
    let d = verify_module_op(&op);
    for x in &d.0 {
        // SAFETY: the host\'s callback and data, as it gave them.
        unsafe { say(on_error, user_data, &x.to_string()) };
    }
    result(!d.has_errors())
}

/// See `nnscalerListPasses` in `nnscaler.h`.
///
/// # Safety
/// `callback` must be a valid function taking `user_data`.
#[no_mangle]
pub unsafe extern "C" fn nnscalerListPasses(callback: MlirStringCallback, user_data: *mut c_void) {
    for p in PASSES {
        // SAFETY: the host\'s callback and data, as it gave them.
        unsafe { say(callback, user_data, &format!("{}: {}", p.name, p.summary)) };
    }
}

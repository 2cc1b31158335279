//! In-place edits of MLIR through its C API: create an op at a point, set operands and
//! types, set and remove attributes, move, erase. Passes change the IR they were given and
//! nothing else: ops, attributes and locations they do not touch stay the very same MLIR
//! objects (typed attributes keep their types, locations keep their fused/name/call-site
//! structure), and nothing is printed and re-parsed.
//!
//! The functions take raw handles (`MlirOperation`, `MlirValue`): melior's borrowed
//! `OperationRef`s cannot be held across the edits a rewrite makes. Callers guarantee the
//! handles are alive and belong to one context.

use crate::diag::SrcLoc;
use crate::types::{AttrValue, TensorType};
use mlir_sys::*;
use std::collections::HashMap;

/// A `&str` as an `MlirStringRef` (valid while `s` lives).
pub(crate) fn sref(s: &str) -> MlirStringRef {
    MlirStringRef {
        data: s.as_ptr().cast(),
        length: s.len(),
    }
}

/// The text of an `MlirStringRef` (an empty one may have a null pointer).
///
/// # Safety
/// `r` must point at `r.length` readable bytes (or be empty).
pub unsafe fn string_of(r: MlirStringRef) -> String {
    if r.length == 0 || r.data.is_null() {
        return String::new();
    }
    // SAFETY: guaranteed by the caller, and checked non-null and non-empty above.
    let bytes = unsafe { std::slice::from_raw_parts(r.data.cast::<u8>(), r.length) };
    String::from_utf8_lossy(bytes).into_owned()
}

unsafe extern "C" fn append(text: MlirStringRef, data: *mut std::ffi::c_void) {
    // SAFETY: `data` is the `String` handed to `print_with`, and `text` is valid during the
    // call.
    unsafe {
        let out = &mut *data.cast::<String>();
        out.push_str(&string_of(text));
    }
}

/// Collects what an MLIR print function (`mlirAttributePrint`, ...) writes through its
/// callback: `print_with(|cb, ud| unsafe { mlirAttributePrint(a, cb, ud) })`.
pub fn print_with(f: impl FnOnce(MlirStringCallback, *mut std::ffi::c_void)) -> String {
    let mut out = String::new();
    f(Some(append), (&mut out as *mut String).cast());
    out
}

/// Builds attributes and types in one context, caching what it parsed.
#[derive(Debug)]
pub struct Builder {
    ctx: MlirContext,
    types: HashMap<String, MlirType>,
}

impl Builder {
    /// A builder for the context of `op`.
    ///
    /// # Safety
    /// `op` must be a live operation.
    pub unsafe fn for_op(op: MlirOperation) -> Self {
        // SAFETY: the caller guarantees `op` is live.
        let ctx = unsafe { mlirOperationGetContext(op) };
        Builder {
            ctx,
            types: HashMap::new(),
        }
    }

    /// The MLIR type of `ty`.
    pub fn tensor_type(&mut self, ty: &TensorType) -> Result<MlirType, String> {
        let text = ty.to_string();
        if let Some(t) = self.types.get(&text) {
            return Ok(*t);
        }
        // SAFETY: the context is live (it owns the op this builder was made for).
        let t = unsafe { mlirTypeParseGet(self.ctx, sref(&text)) };
        if t.ptr.is_null() {
            return Err(format!("cannot build the type {text}"));
        }
        self.types.insert(text, t);
        Ok(t)
    }

    /// The MLIR attribute of `v`, made through the attribute API: `Int` as `i64`, `Float`
    /// as `f64`, `Ints` as `array<i64: ...>`, `Strs` as an array of strings, `Nns` as the
    /// opaque `#nns.kind<body>`; only `Other` (text nnscaler does not interpret) is parsed.
    pub fn attribute(&self, v: &AttrValue) -> Result<MlirAttribute, String> {
        let ctx = self.ctx;
        // SAFETY: the context is live; every call only builds uniqued attributes from the
        // values given, and the slices and strings outlive the calls.
        let a = unsafe {
            match v {
                AttrValue::Unit => mlirUnitAttrGet(ctx),
                AttrValue::Bool(b) => mlirBoolAttrGet(ctx, i32::from(*b)),
                AttrValue::Int(n) => mlirIntegerAttrGet(mlirIntegerTypeGet(ctx, 64), *n),
                AttrValue::Float(x) => mlirFloatAttrDoubleGet(ctx, mlirF64TypeGet(ctx), *x),
                AttrValue::Str(s) => mlirStringAttrGet(ctx, sref(s)),
                AttrValue::Ints(v) => mlirDenseI64ArrayGet(ctx, v.len() as isize, v.as_ptr()),
                AttrValue::Strs(v) => {
                    let items: Vec<MlirAttribute> =
                        v.iter().map(|s| mlirStringAttrGet(ctx, sref(s))).collect();
                    mlirArrayAttrGet(ctx, items.len() as isize, items.as_ptr())
                }
                AttrValue::Layout(_)
                | AttrValue::Split(_)
                | AttrValue::Axes(_)
                | AttrValue::Nns { .. } => {
                    // OpaqueAttr::get, not the parser: the parser's check of the dialect
                    // namespace compiles a regular expression for every attribute.
                    let (kind, body) = v.nns_parts().expect("an nns attribute");
                    let data = format!("{kind}<{body}>");
                    mlirOpaqueAttrGet(
                        ctx,
                        sref("nns"),
                        data.len() as isize,
                        data.as_ptr().cast(),
                        mlirNoneTypeGet(ctx),
                    )
                }
                AttrValue::Layouts(v) => {
                    let items = v
                        .iter()
                        .map(|l| self.attribute(&AttrValue::Layout(l.clone())))
                        .collect::<Result<Vec<MlirAttribute>, String>>()?;
                    mlirArrayAttrGet(ctx, items.len() as isize, items.as_ptr())
                }
                AttrValue::Other(text) => mlirAttributeParseGet(ctx, sref(text)),
            }
        };
        if a.ptr.is_null() {
            return Err(format!("cannot build the attribute {}", v.to_mlir_text()));
        }
        Ok(a)
    }

    /// A named attribute.
    pub fn named(&self, name: &str, attr: MlirAttribute) -> MlirNamedAttribute {
        // SAFETY: as in `tensor_type`; the identifier is uniqued by the context.
        unsafe { mlirNamedAttributeGet(mlirIdentifierGet(self.ctx, sref(name)), attr) }
    }

    /// The location for `loc`: the MLIR location it was read from when it has one (fused,
    /// name and call-site structure kept), else `file:line:col`, else `fallback`.
    pub fn location(&self, loc: &SrcLoc, fallback: MlirLocation) -> MlirLocation {
        if let Some(raw) = loc.raw {
            return raw.0;
        }
        if loc.line > 0 {
            // SAFETY: as in `tensor_type`.
            return unsafe {
                mlirLocationFileLineColGet(
                    self.ctx,
                    sref(&loc.file),
                    loc.line as u32,
                    loc.col as u32,
                )
            };
        }
        fallback
    }

    /// Creates (without inserting) op `name` with `operands`, `results` types and `attrs`.
    pub fn create_op(
        &self,
        name: &str,
        operands: &[MlirValue],
        results: &[MlirType],
        attrs: &[MlirNamedAttribute],
        loc: MlirLocation,
    ) -> MlirOperation {
        // SAFETY: the state is filled from live handles of this context and consumed by
        // mlirOperationCreate; the slices outlive the calls.
        unsafe {
            let mut state = mlirOperationStateGet(sref(name), loc);
            mlirOperationStateAddOperands(&mut state, operands.len() as isize, operands.as_ptr());
            mlirOperationStateAddResults(&mut state, results.len() as isize, results.as_ptr());
            mlirOperationStateAddAttributes(&mut state, attrs.len() as isize, attrs.as_ptr());
            mlirOperationCreate(&mut state)
        }
    }
}

/// Sets attribute `name` of `op`.
///
/// # Safety
/// `op` and `attr` must be live and of one context.
pub unsafe fn set_attr(op: MlirOperation, name: &str, attr: MlirAttribute) {
    // SAFETY: guaranteed by the caller.
    unsafe { mlirOperationSetAttributeByName(op, sref(name), attr) }
}

/// Removes attribute `name` of `op` (if present).
///
/// # Safety
/// `op` must be live.
pub unsafe fn remove_attr(op: MlirOperation, name: &str) {
    // SAFETY: guaranteed by the caller.
    unsafe {
        mlirOperationRemoveAttributeByName(op, sref(name));
    }
}

/// Whether any result of `op` is still used.
///
/// # Safety
/// `op` must be live.
pub unsafe fn has_uses(op: MlirOperation) -> bool {
    // SAFETY: guaranteed by the caller; results are read-only here.
    unsafe {
        (0..mlirOperationGetNumResults(op))
            .any(|i| !mlirOpOperandIsNull(mlirValueGetFirstUse(mlirOperationGetResult(op, i))))
    }
}

/// Erases `op`, which must have no uses left.
///
/// # Safety
/// `op` must be live; it is destroyed.
pub unsafe fn erase(op: MlirOperation) -> Result<(), String> {
    // SAFETY: guaranteed by the caller.
    unsafe {
        if has_uses(op) {
            return Err("internal error: erasing an op whose results are still used".into());
        }
        mlirOperationDestroy(op);
    }
    Ok(())
}

/// Places `op` (already in `block`) right after `prev`, or first in `block` when `prev` is
/// null.
///
/// # Safety
/// `op` and `prev` (if not null) must be live ops of `block`.
pub unsafe fn place_after(block: MlirBlock, op: MlirOperation, prev: MlirOperation) {
    // SAFETY: guaranteed by the caller.
    unsafe {
        if prev.ptr.is_null() {
            let first = mlirBlockGetFirstOperation(block);
            if first.ptr != op.ptr {
                mlirOperationMoveBefore(op, first);
            }
        } else if mlirOperationGetNextInBlock(prev).ptr != op.ptr {
            mlirOperationMoveAfter(op, prev);
        }
    }
}

/// Inserts new (unowned) `op` right after `prev` in `block`, or first when `prev` is null.
///
/// # Safety
/// `op` must be a created, not yet inserted op; `prev` (if not null) an op of `block`.
pub unsafe fn insert_after(block: MlirBlock, op: MlirOperation, prev: MlirOperation) {
    // SAFETY: guaranteed by the caller; the block takes ownership of `op`.
    unsafe { mlirBlockInsertOwnedOperationAfter(block, prev, op) }
}

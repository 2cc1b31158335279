//! The CPU runtime's tensors are the runtimes' one tensor type ([`nnscaler_rt::tensor`]);
//! what relates them to the IR's tensor types is here.

use nnscaler_dialects::types::{Elem, TensorType};
pub use nnscaler_rt::tensor::{numel, strides, Data, Tensor};

/// Whether tensor `t` has the shape and element kind of IR type `ty`.
pub fn matches(t: &Tensor, ty: &TensorType) -> bool {
    t.shape == dims(ty) && t.is_float() == ty.elem.is_float()
}

/// The shape of an IR tensor type as `usize`s.
pub fn dims(ty: &TensorType) -> Vec<usize> {
    ty.shape.iter().map(|&d| d.max(0) as usize).collect()
}

/// Whether element type `e` can be held by the CPU runtime, and how.
pub fn supported(e: Elem) -> bool {
    matches!(e, Elem::F32 | Elem::I64 | Elem::I32)
}

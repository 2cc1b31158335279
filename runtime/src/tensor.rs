//! Owned, contiguous, row-major tensors: `f32` for floats, `i64` for integers.

use nnscaler_dialects::types::{Elem, TensorType};
use std::fmt;

/// The elements of a tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    /// Floating point values (every float type of the IR runs as f32 on the CPU).
    F32(Vec<f32>),
    /// Integer values (token ids, targets).
    I64(Vec<i64>),
}

/// A tensor: a shape and its elements in row-major order.
#[derive(Clone, PartialEq)]
pub struct Tensor {
    /// Dimension lengths (empty for a scalar).
    pub shape: Vec<usize>,
    /// Elements, `shape.iter().product()` of them.
    pub data: Data,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (kind, n) = match &self.data {
            Data::F32(v) => ("f32", v.len()),
            Data::I64(v) => ("i64", v.len()),
        };
        write!(f, "Tensor<{:?} x {kind}; {n} elements>", self.shape)
    }
}

/// Number of elements of `shape`.
pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Row-major strides of `shape`.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

impl Tensor {
    /// A float tensor from its shape and data; panics if the lengths disagree (a kernel bug).
    pub fn f32(shape: &[usize], data: Vec<f32>) -> Self {
        assert_eq!(
            numel(shape),
            data.len(),
            "shape {shape:?} vs {} elements",
            data.len()
        );
        Tensor {
            shape: shape.to_vec(),
            data: Data::F32(data),
        }
    }

    /// An integer tensor from its shape and data.
    pub fn i64(shape: &[usize], data: Vec<i64>) -> Self {
        assert_eq!(
            numel(shape),
            data.len(),
            "shape {shape:?} vs {} elements",
            data.len()
        );
        Tensor {
            shape: shape.to_vec(),
            data: Data::I64(data),
        }
    }

    /// A float tensor of zeros.
    pub fn zeros(shape: &[usize]) -> Self {
        Tensor::f32(shape, vec![0.0; numel(shape)])
    }

    /// A float scalar.
    pub fn scalar(x: f32) -> Self {
        Tensor::f32(&[], vec![x])
    }

    /// A zero tensor of IR type `ty`.
    pub fn zeros_of(ty: &TensorType) -> Self {
        let shape = dims(ty);
        if ty.elem.is_float() {
            Tensor::zeros(&shape)
        } else {
            Tensor::i64(&shape, vec![0; numel(&shape)])
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }

    /// Whether the elements are floats.
    pub fn is_float(&self) -> bool {
        matches!(self.data, Data::F32(_))
    }

    /// The float elements (an error names the problem for integer tensors).
    pub fn f(&self) -> Result<&[f32], String> {
        match &self.data {
            Data::F32(v) => Ok(v),
            Data::I64(_) => Err("expected a float tensor, got integers".into()),
        }
    }

    /// The integer elements.
    pub fn ints(&self) -> Result<&[i64], String> {
        match &self.data {
            Data::I64(v) => Ok(v),
            Data::F32(_) => Err("expected an integer tensor, got floats".into()),
        }
    }

    /// Consumes the tensor, returning its float elements.
    pub fn into_f32(self) -> Result<Vec<f32>, String> {
        match self.data {
            Data::F32(v) => Ok(v),
            Data::I64(_) => Err("expected a float tensor, got integers".into()),
        }
    }

    /// The same elements under another shape of equal size.
    pub fn reshaped(mut self, shape: &[usize]) -> Self {
        assert_eq!(numel(shape), self.numel());
        self.shape = shape.to_vec();
        self
    }

    /// Whether this tensor has the shape and element kind of `ty`.
    pub fn matches(&self, ty: &TensorType) -> bool {
        self.shape == dims(ty) && self.is_float() == ty.elem.is_float()
    }

    /// `tensor<2x3xf32>`-style description, for messages.
    pub fn describe(&self) -> String {
        let mut s = String::from("tensor<");
        for d in &self.shape {
            s += &format!("{d}x");
        }
        s += if self.is_float() { "f32>" } else { "i64>" };
        s
    }

    /// `max |a - b| / max |b|`: the error relative to the reference's largest magnitude
    /// (0 when both are all zeros); `None` if the shapes or kinds differ.
    pub fn rel_err(&self, reference: &Tensor) -> Option<f64> {
        if self.shape != reference.shape {
            return None;
        }
        match (&self.data, &reference.data) {
            (Data::F32(a), Data::F32(b)) => {
                let scale = b.iter().map(|x| f64::from(x.abs())).fold(0.0, f64::max);
                let diff = a
                    .iter()
                    .zip(b)
                    .map(|(x, y)| {
                        let d = f64::from(*x) - f64::from(*y);
                        if d.is_nan() {
                            f64::INFINITY
                        } else {
                            d.abs()
                        }
                    })
                    .fold(0.0, f64::max);
                Some(if diff == 0.0 {
                    0.0
                } else {
                    diff / scale.max(f64::MIN_POSITIVE)
                })
            }
            (Data::I64(a), Data::I64(b)) => Some(if a == b { 0.0 } else { f64::INFINITY }),
            _ => None,
        }
    }
}

/// The shape of an IR tensor type as `usize`s.
pub fn dims(ty: &TensorType) -> Vec<usize> {
    ty.shape.iter().map(|&d| d.max(0) as usize).collect()
}

/// Whether element type `e` can be held by the CPU runtime, and how.
pub fn supported(e: Elem) -> bool {
    matches!(e, Elem::F32 | Elem::I64 | Elem::I32)
}

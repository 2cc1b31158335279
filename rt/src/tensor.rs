//! The tensor every runtime holds: the CPU runtime's simulated devices, the compiled host
//! backend and the CUDA backend's inputs and outputs (an owned, contiguous, row-major shape
//! and elements: `f32` for floats, `i64` for integers), and safetensors files of them.

use crate::artifact::Elt;
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;

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

/// The elements of range `r` of dim `dim` of a row-major tensor `x` of `shape`: one run
/// of `r.len()` rows of the dims after `dim` for each index of the dims before it.
pub fn narrow_elems<T: Copy>(x: &[T], shape: &[usize], dim: usize, r: Range<usize>) -> Vec<T> {
    let (outer, n, inner) = (numel(&shape[..dim]), shape[dim], numel(&shape[dim + 1..]));
    let mut out = Vec::with_capacity(outer * r.len() * inner);
    for o in 0..outer {
        out.extend_from_slice(&x[(o * n + r.start) * inner..(o * n + r.end) * inner]);
    }
    out
}

/// An artifact's shape (`u64`s, as files hold them) as a tensor's.
pub fn shape(dims: &[u64]) -> Vec<usize> {
    dims.iter().map(|&d| d as usize).collect()
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
    /// A tensor of `shape` holding `data`; panics if the lengths disagree (a kernel bug).
    fn of(shape: &[usize], data: Data) -> Self {
        let len = match &data {
            Data::F32(v) => v.len(),
            Data::I64(v) => v.len(),
        };
        assert_eq!(numel(shape), len, "shape {shape:?} vs {len} elements");
        Tensor {
            shape: shape.to_vec(),
            data,
        }
    }

    /// A float tensor from its shape and data; panics if the lengths disagree (a kernel bug).
    pub fn f32(shape: &[usize], data: Vec<f32>) -> Self {
        Tensor::of(shape, Data::F32(data))
    }

    /// An integer tensor from its shape and data.
    pub fn i64(shape: &[usize], data: Vec<i64>) -> Self {
        Tensor::of(shape, Data::I64(data))
    }

    /// A float tensor of zeros.
    pub fn zeros(shape: &[usize]) -> Self {
        Tensor::f32(shape, vec![0.0; numel(shape)])
    }

    /// A float scalar.
    pub fn scalar(x: f32) -> Self {
        Tensor::f32(&[], vec![x])
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

    /// Range `r` of dim `dim`.
    pub fn narrow(&self, dim: usize, r: Range<usize>) -> Tensor {
        let mut shape = self.shape.clone();
        shape[dim] = r.len();
        let data = match &self.data {
            Data::F32(v) => Data::F32(narrow_elems(v, &self.shape, dim, r)),
            Data::I64(v) => Data::I64(narrow_elems(v, &self.shape, dim, r)),
        };
        Tensor { shape, data }
    }

    /// Piece `k` of `n` equal ones along dim `dim` (an error where `n` does not divide it).
    pub fn piece(&self, dim: usize, n: usize, k: usize) -> Result<Tensor, String> {
        let len = self.shape[dim];
        if !len.is_multiple_of(n) {
            return Err(format!("dim {dim} of length {len} does not split {n} ways"));
        }
        let w = len / n;
        Ok(self.narrow(dim, k * w..(k + 1) * w))
    }

    /// Its element type.
    pub fn elt(&self) -> Elt {
        match self.data {
            Data::F32(_) => Elt::F32,
            Data::I64(_) => Elt::I64,
        }
    }

    /// Its elements' little-endian bytes.
    pub fn bytes(&self) -> Vec<u8> {
        match &self.data {
            Data::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Data::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// Whether its shape is `shape` (an artifact's shapes are `u64`s).
    pub fn has_shape(&self, shape: &[u64]) -> bool {
        self.shape.len() == shape.len()
            && self.shape.iter().zip(shape).all(|(&a, &b)| a as u64 == b)
    }
}

/// Reads every tensor of a safetensors file (f32, i64; i32 widened to i64).
pub fn read(path: &str) -> Result<BTreeMap<String, Tensor>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| format!("{path}: not a valid safetensors file ({e})"))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let shape: Vec<usize> = view.shape().to_vec();
        let raw = view.data();
        let data = match view.dtype() {
            Dtype::F32 => Data::F32(
                raw.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect(),
            ),
            Dtype::I64 => Data::I64(
                raw.chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect(),
            ),
            Dtype::I32 => Data::I64(
                raw.chunks_exact(4)
                    .map(|c| i64::from(i32::from_le_bytes(c.try_into().expect("4 bytes"))))
                    .collect(),
            ),
            d => {
                return Err(format!(
                    "{path}: tensor '{name}' is {d:?}; f32, i64 and i32 are read"
                ))
            }
        };
        out.insert(name, Tensor { shape, data });
    }
    Ok(out)
}

/// Safetensors bytes of named tensors.
pub fn to_bytes(tensors: &[(String, Tensor)]) -> Result<Vec<u8>, String> {
    let owned: Vec<(String, Vec<u8>, Dtype, Vec<usize>)> = tensors
        .iter()
        .map(|(n, t)| {
            let dtype = match t.elt() {
                Elt::F32 => Dtype::F32,
                Elt::I64 => Dtype::I64,
                Elt::Bf16 => Dtype::BF16,
            };
            (n.clone(), t.bytes(), dtype, t.shape.clone())
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, b, d, s)| {
            safetensors::tensor::TensorView::new(*d, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    safetensors::serialize(views, None).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A range of a middle dim keeps every outer index's run; a piece is an equal range,
    /// and a dim that does not divide is an error naming it.
    #[test]
    fn narrow_and_piece_cut_row_major_runs() {
        let t = Tensor::i64(&[2, 4, 3], (0..24).collect());
        let n = t.narrow(1, 1..3);
        assert_eq!(n.shape, vec![2, 2, 3]);
        assert_eq!(
            n.ints().unwrap(),
            &[3, 4, 5, 6, 7, 8, 15, 16, 17, 18, 19, 20]
        );
        assert_eq!(t.piece(1, 2, 1).unwrap(), t.narrow(1, 2..4));
        assert_eq!(
            t.piece(2, 2, 0).unwrap_err(),
            "dim 2 of length 3 does not split 2 ways"
        );
    }
}

//! Tensors as the runtime sees them, and safetensors files of them.

use crate::artifact::Elt;
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;

/// Elements.
#[derive(Clone, Debug, PartialEq)]
pub enum Values {
    /// f32.
    F32(Vec<f32>),
    /// i64.
    I64(Vec<i64>),
}

/// A row-major tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Dimension lengths.
    pub shape: Vec<u64>,
    /// Elements.
    pub data: Values,
}

impl Tensor {
    /// Its element type.
    pub fn elt(&self) -> Elt {
        match self.data {
            Values::F32(_) => Elt::F32,
            Values::I64(_) => Elt::I64,
        }
    }

    /// Its elements' little-endian bytes.
    pub fn bytes(&self) -> Vec<u8> {
        match &self.data {
            Values::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Values::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

/// Reads every tensor of a safetensors file (f32, i64; i32 widened to i64).
pub fn read(path: &str) -> Result<BTreeMap<String, Tensor>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| format!("{path}: not a valid safetensors file ({e})"))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let shape: Vec<u64> = view.shape().iter().map(|&d| d as u64).collect();
        let raw = view.data();
        let data = match view.dtype() {
            Dtype::F32 => Values::F32(
                raw.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect(),
            ),
            Dtype::I64 => Values::I64(
                raw.chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect(),
            ),
            Dtype::I32 => Values::I64(
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
            (
                n.clone(),
                t.bytes(),
                dtype,
                t.shape.iter().map(|&d| d as usize).collect(),
            )
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

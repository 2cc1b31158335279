//! CPU kernels for every `dnn` op, forward and backward, keyed by op name.
//!
//! A kernel receives its operands and a [`Ctx`] (the op's attributes and the result types
//! the IR declares) and returns its results. Kernels trust the verifier for structure
//! (operand counts, attribute kinds, shapes) and check data-dependent facts themselves
//! (token ids inside the table, targets inside the vocabulary).

mod elementwise;
mod formula;
pub mod linalg;
pub mod math;
mod nn;
mod shape;

use crate::tensor::{dims, Tensor};
use nnscaler_dialects::types::{AttrValue, Attrs, TensorType};
use std::sync::atomic::{AtomicUsize, Ordering};

pub use linalg::gemm;
pub use nn::rotary_table;

/// What a kernel knows about its op besides the operands.
#[derive(Clone, Copy, Debug)]
pub struct Ctx<'a> {
    /// The op's name (`dnn.add`).
    pub op: &'a str,
    /// The op's attributes.
    pub attrs: &'a Attrs,
    /// The result types the IR declares.
    pub out: &'a [TensorType],
    /// The simulated device running the op, if any.
    pub device: Option<&'a DeviceInfo>,
}

/// A device's place in its mesh, for the ops of a localized program whose local
/// computation depends on which shard the device holds (`row_axes`, `offset_axes`).
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// Mesh axis names.
    pub names: Vec<String>,
    /// Mesh axis sizes.
    pub sizes: Vec<usize>,
    /// This device's coordinates.
    pub coords: Vec<usize>,
}

/// A kernel: operands in, results out; errors are messages without location.
pub type Kernel = fn(&Ctx<'_>, &[&Tensor]) -> Result<Vec<Tensor>, String>;

static THREADS: AtomicUsize = AtomicUsize::new(1);

/// Sets how many threads the matrix products use (default 1).
pub fn set_threads(n: usize) {
    THREADS.store(n.max(1), Ordering::Relaxed);
}

pub(crate) fn threads() -> usize {
    THREADS.load(Ordering::Relaxed)
}

impl Ctx<'_> {
    pub(crate) fn int(&self, name: &str, default: i64) -> i64 {
        match self.attrs.get(name) {
            Some(AttrValue::Int(n)) => *n,
            _ => default,
        }
    }

    pub(crate) fn float(&self, name: &str, default: f64) -> f64 {
        match self.attrs.get(name) {
            Some(AttrValue::Float(x)) => *x,
            Some(AttrValue::Int(n)) => *n as f64,
            _ => default,
        }
    }

    pub(crate) fn flag(&self, name: &str) -> bool {
        nnscaler_dialects::types::flag(self.attrs, name)
    }

    pub(crate) fn ints(&self, name: &str) -> Vec<i64> {
        match self.attrs.get(name) {
            Some(AttrValue::Ints(v)) => v.clone(),
            _ => Vec::new(),
        }
    }

    /// The global index where this device's shard of a dim starts: the dim is split over
    /// the axes named by string-array attribute `attr` (outer first) into blocks of
    /// `local_len`; 0 when the attribute is absent (an unsplit op).
    pub(crate) fn block_offset(&self, attr: &str, local_len: usize) -> Result<usize, String> {
        Ok(self.block(attr, local_len)?.0)
    }

    /// Where this device's shard of a dim starts and how long the whole dim is (see
    /// [`Ctx::block_offset`]); `(0, local_len)` when the attribute is absent. Kernels check
    /// indices against the whole length, so an index no shard holds is an error on every
    /// device, as it is on one.
    pub(crate) fn block(&self, attr: &str, local_len: usize) -> Result<(usize, usize), String> {
        let axes = match self.attrs.get(attr) {
            None => return Ok((0, local_len)),
            Some(AttrValue::Strs(v)) => v,
            Some(_) => return Err(format!("'{attr}' must be an array of mesh axis names")),
        };
        let dev = self.device.ok_or_else(|| {
            format!("'{attr}' needs a simulated device (run the localized program on its mesh)")
        })?;
        let (mut block, mut blocks) = (0, 1);
        for a in axes {
            let i = dev
                .names
                .iter()
                .position(|n| n == a)
                .ok_or_else(|| format!("'{attr}' names unknown mesh axis '{a}'"))?;
            block = block * dev.sizes[i] + dev.coords[i];
            blocks *= dev.sizes[i];
        }
        Ok((block * local_len, blocks * local_len))
    }

    /// Shape of result `i`.
    pub(crate) fn out_shape(&self, i: usize) -> Vec<usize> {
        self.out.get(i).map(dims).unwrap_or_default()
    }

    /// Attribute `name` as a dimension of a rank-`rank` tensor (negative counts from the end).
    pub(crate) fn dim(&self, name: &str, default: i64, rank: usize) -> usize {
        norm_dim(self.int(name, default), rank)
    }

    /// The `dims` attribute, normalized and sorted.
    pub(crate) fn dims(&self, rank: usize) -> Vec<usize> {
        let mut v: Vec<usize> = self
            .ints("dims")
            .into_iter()
            .map(|d| norm_dim(d, rank))
            .collect();
        v.sort_unstable();
        v
    }
}

pub(crate) fn norm_dim(d: i64, rank: usize) -> usize {
    if d < 0 {
        (d + rank as i64).max(0) as usize
    } else {
        d as usize
    }
}

/// `(outer, n, inner)`: the shape seen as `[outer, n, inner]` around dimension `dim`.
pub(crate) fn around(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    let outer = shape[..dim].iter().product();
    let inner = shape[dim + 1..].iter().product();
    (outer, shape[dim], inner)
}

/// The kernel of op `name`, if the runtime has one: every op with a scalar formula runs
/// it ([`formula`]), the others have kernels of their own.
pub fn kernel(name: &str) -> Option<Kernel> {
    use elementwise as e;
    if nnscaler_dialects::dnn::spec(name).is_some_and(|s| s.traits.scalar.is_some()) {
        return Some(formula::formula);
    }
    Some(match name {
        "dnn.matmul" => linalg::matmul,
        "dnn.linear" => linalg::linear,
        "dnn.linear_weight_grad" => linalg::linear_weight_grad,
        "dnn.attention" => linalg::attention,
        "dnn.attention_grad" => linalg::attention_grad,
        "dnn.dropout" => e::dropout,
        "dnn.fill" => e::fill,
        "dnn.adamw" => e::adamw,
        "dnn.clip_scale" => e::clip_scale,
        "dnn.broadcast_to" => e::broadcast_to,
        "dnn.softmax" => nn::softmax,
        "dnn.log_softmax" => nn::log_softmax,
        "dnn.softmax_grad" => nn::softmax_grad,
        "dnn.log_softmax_grad" => nn::log_softmax_grad,
        "dnn.layer_norm" => nn::layer_norm,
        "dnn.layer_norm_grad" => nn::layer_norm_grad,
        "dnn.rms_norm" => nn::rms_norm,
        "dnn.rms_norm_grad" => nn::rms_norm_grad,
        "dnn.embedding" => nn::embedding,
        "dnn.embedding_grad" => nn::embedding_grad,
        "dnn.rotary" => nn::rotary,
        "dnn.rotary_grad" => nn::rotary_grad,
        "dnn.cross_entropy" => nn::cross_entropy,
        "dnn.cross_entropy_grad" => nn::cross_entropy_grad,
        "dnn.pick" => nn::pick,
        "dnn.pick_grad" => nn::pick_grad,
        "dnn.softmax_xent_grad" => nn::softmax_xent_grad,
        "dnn.reshape" => shape::reshape,
        "dnn.transpose" => shape::transpose,
        "dnn.slice" => shape::slice,
        "dnn.pad" => shape::pad,
        "dnn.concat" => shape::concat,
        "dnn.split" => shape::split,
        "dnn.sum" => shape::sum,
        "dnn.mean" => shape::mean,
        "dnn.max" => shape::max,
        "dnn.max_grad" => shape::max_grad,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_dnn_op_has_a_kernel() {
        let missing: Vec<&str> = nnscaler_dialects::dnn::SPECS
            .iter()
            .map(|s| s.name)
            .filter(|n| super::kernel(n).is_none())
            .collect();
        assert!(missing.is_empty(), "ops without a CPU kernel: {missing:?}");
    }
}

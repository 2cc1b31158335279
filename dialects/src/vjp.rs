//! What VJP rules are written against: for each forward `dnn` op, the backward ops that
//! turn the gradients of its results into the gradients of its operands. The rules
//! themselves live with their ops' families (`dnn::elementwise`, `dnn::norms`, ...;
//! [`crate::dnn::vjp_rule`] finds one); `--autodiff` calls them in reverse program order.
//! Everything they emit is ordinary `dnn` ops with their own annotations, so the backward
//! graph is partitioned like the forward one. A rule emits through [`Emit`] (a
//! [`Graph`](crate::graph::Graph) is one), so this module and the families need not know
//! the graph.

use crate::diag::SrcLoc;
use crate::types::{AttrValue, Attrs, Elem, TensorType, ValueId};

/// Where a VJP rule emits its ops: a program it can add `dnn` ops to and read value types
/// from.
pub trait Emit: std::fmt::Debug {
    /// The type of value `v`.
    fn value(&self, v: ValueId) -> &TensorType;
    /// Appends `dnn` op `op` of operands `ins` and attributes `attrs`, its result types
    /// inferred; returns its results.
    fn emit(
        &mut self,
        op: &str,
        ins: &[ValueId],
        attrs: Attrs,
        loc: &SrcLoc,
    ) -> Result<Vec<ValueId>, String>;
}

/// The forward op a rule differentiates.
#[derive(Clone, Debug)]
pub struct Forward {
    /// Its operands.
    pub inputs: Vec<ValueId>,
    /// Its results.
    pub outputs: Vec<ValueId>,
    /// Its attributes.
    pub attrs: Attrs,
    /// Where it is in the source.
    pub loc: SrcLoc,
}

/// What a VJP rule sees: the program to emit into, the forward op, the gradients of its
/// results (`None`: the result does not reach the loss) and which operands need gradients.
#[derive(Debug)]
pub struct VjpCtx<'g> {
    /// The program being extended.
    pub g: &'g mut dyn Emit,
    /// The forward op.
    pub node: Forward,
    /// Gradient of each result.
    pub dys: Vec<Option<ValueId>>,
    /// Whether each operand needs a gradient.
    pub needs: Vec<bool>,
}

/// A VJP rule: returns one gradient (or `None`) per operand.
pub type VjpRule = fn(&mut VjpCtx<'_>) -> Result<Vec<Option<ValueId>>, String>;

impl VjpCtx<'_> {
    /// Operand `i`.
    pub fn x(&self, i: usize) -> ValueId {
        self.node.inputs[i]
    }

    /// Result `i`.
    pub fn y(&self, i: usize) -> ValueId {
        self.node.outputs[i]
    }

    /// Shape of value `v`.
    pub fn shape(&self, v: ValueId) -> Vec<i64> {
        self.g.value(v).shape.clone()
    }

    /// Gradient of result `i` (zeros when the result does not reach the loss).
    pub fn dy(&mut self, i: usize) -> Result<ValueId, String> {
        match self.dys[i] {
            Some(d) => Ok(d),
            None => {
                let ty = self.g.value(self.y(i)).clone();
                let zeros = self.fill(&ty.shape, 0.0)?;
                if ty.elem == Elem::F32 {
                    return Ok(zeros);
                }
                self.emit(
                    "dnn.cast",
                    &[zeros],
                    &[("to", AttrValue::Str(ty.elem.to_string()))],
                )
            }
        }
    }

    fn loc(&self) -> SrcLoc {
        self.node.loc.clone()
    }

    /// Emits a single-result op.
    pub fn emit(
        &mut self,
        op: &str,
        ins: &[ValueId],
        attrs: &[(&str, AttrValue)],
    ) -> Result<ValueId, String> {
        let loc = self.loc();
        match self.g.emit(op, ins, to_attrs(attrs), &loc)?.as_slice() {
            [y] => Ok(*y),
            ys => Err(format!("'{op}' has {} results, expected one", ys.len())),
        }
    }

    /// Emits an op with several results.
    pub fn emit_n(
        &mut self,
        op: &str,
        ins: &[ValueId],
        attrs: &[(&str, AttrValue)],
    ) -> Result<Vec<ValueId>, String> {
        let loc = self.loc();
        self.g.emit(op, ins, to_attrs(attrs), &loc)
    }

    /// The forward op's attributes named in `keys` (those present).
    pub fn keep(&self, keys: &[&str]) -> Vec<(&'static str, AttrValue)> {
        keys.iter()
            .filter_map(|k| self.node.attrs.get(*k).map(|v| (static_key(k), v.clone())))
            .collect()
    }

    /// A constant f32 tensor.
    pub fn fill(&mut self, shape: &[i64], value: f64) -> Result<ValueId, String> {
        self.emit(
            "dnn.fill",
            &[],
            &[
                ("shape", AttrValue::Ints(shape.to_vec())),
                ("value", AttrValue::Float(value)),
            ],
        )
    }

    /// `v` reshaped to `shape` (no op when the shape already matches).
    pub fn reshape(&mut self, v: ValueId, shape: &[i64]) -> Result<ValueId, String> {
        if self.g.value(v).shape == shape {
            return Ok(v);
        }
        self.emit(
            "dnn.reshape",
            &[v],
            &[("shape", AttrValue::Ints(shape.to_vec()))],
        )
    }

    /// `v * c` for a scalar constant `c`.
    pub fn scale(&mut self, v: ValueId, c: f64) -> Result<ValueId, String> {
        let k = self.fill(&[], c)?;
        self.emit("dnn.mul", &[v, k], &[])
    }

    /// Sums a broadcast gradient `v` back to `shape` (the inverse of numpy broadcasting).
    pub fn sum_to(&mut self, v: ValueId, shape: &[i64]) -> Result<ValueId, String> {
        let s = self.shape(v);
        if s == shape {
            return Ok(v);
        }
        let off = s.len() - shape.len();
        let dims: Vec<i64> = (0..s.len())
            .filter(|&i| i < off || (shape[i - off] == 1 && s[i] != 1))
            .map(|i| i as i64)
            .collect();
        let summed = if dims.is_empty() {
            v
        } else {
            self.emit("dnn.sum", &[v], &[("dims", AttrValue::Ints(dims))])?
        };
        self.reshape(summed, shape)
    }

    /// Swaps the last two dims of `v`.
    pub fn swap_last(&mut self, v: ValueId) -> Result<ValueId, String> {
        let r = self.shape(v).len() as i64;
        let mut perm: Vec<i64> = (0..r).collect();
        perm.swap((r - 1) as usize, (r - 2) as usize);
        self.emit("dnn.transpose", &[v], &[("perm", AttrValue::Ints(perm))])
    }
}

fn static_key(k: &str) -> &'static str {
    const KEYS: &[&str] = &[
        "eps",
        "dim",
        "dims",
        "keepdim",
        "approximate",
        "causal",
        "scale",
        "theta",
        "p",
        "seed",
    ];
    KEYS.iter().find(|x| **x == k).copied().unwrap_or("unknown")
}

fn to_attrs(a: &[(&str, AttrValue)]) -> Attrs {
    a.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

/// An integer attribute.
pub fn int(v: i64) -> AttrValue {
    AttrValue::Int(v)
}

/// Whether values of element type `e` carry gradients.
pub fn differentiable(e: Elem) -> bool {
    e.is_float()
}

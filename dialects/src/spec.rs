//! `OpSpec`: everything nnscaler knows about one op, in one place.
//!
//! Passes never hard-code op knowledge: they ask the op's spec for its annotation (the
//! contract with the partitioner), its result types, its cost and, in later stages, its VJP
//! rule. The CPU kernels live in the runtime, keyed by the same op name.

use crate::annotation::{Annotation, Binding};
use crate::types::{AttrValue, Attrs, Elem, TensorType};

/// The kind of value an attribute must hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttrKind {
    /// An integer.
    Int,
    /// A float (an integer literal is accepted too).
    Float,
    /// `true` / `false`.
    Bool,
    /// A string.
    Str,
    /// An integer array.
    Ints,
    /// A string array (mesh axis names).
    Strs,
}

impl AttrKind {
    fn accepts(self, v: &AttrValue) -> bool {
        matches!(
            (self, v),
            (AttrKind::Int, AttrValue::Int(_))
                | (AttrKind::Float, AttrValue::Float(_) | AttrValue::Int(_))
                | (AttrKind::Bool, AttrValue::Bool(_))
                | (AttrKind::Str, AttrValue::Str(_))
                | (AttrKind::Ints, AttrValue::Ints(_))
                | (AttrKind::Strs, AttrValue::Strs(_))
        )
    }

    /// The kind's name in messages and docs.
    pub fn name(self) -> &'static str {
        match self {
            AttrKind::Int => "integer",
            AttrKind::Float => "float",
            AttrKind::Bool => "bool",
            AttrKind::Str => "string",
            AttrKind::Ints => "integer array",
            AttrKind::Strs => "string array",
        }
    }
}

/// One attribute an op takes.
#[derive(Clone, Copy, Debug)]
pub struct AttrSpec {
    /// Attribute name.
    pub name: &'static str,
    /// Value kind.
    pub kind: AttrKind,
    /// Whether the op is invalid without it.
    pub required: bool,
    /// One line for the docs.
    pub doc: &'static str,
}

/// What an op is told about itself when its spec is asked a question: operand types and
/// attributes.
#[derive(Clone, Copy, Debug)]
pub struct OpCtx<'a> {
    /// Operand types (`None` for an operand that is not a ranked static tensor).
    pub operands: &'a [Option<TensorType>],
    /// Attributes by name.
    pub attrs: &'a Attrs,
}

impl<'a> OpCtx<'a> {
    /// The shape of operand `i`.
    pub fn shape(&self, i: usize) -> Result<&'a [i64], String> {
        match self.operands.get(i) {
            Some(Some(t)) => Ok(&t.shape),
            _ => Err(format!(
                "operand {i} must be a ranked tensor with a static shape"
            )),
        }
    }

    /// The rank of operand `i`.
    pub fn rank(&self, i: usize) -> Result<usize, String> {
        self.shape(i).map(<[i64]>::len)
    }

    /// The element type of operand `i`.
    pub fn elem(&self, i: usize) -> Result<Elem, String> {
        match self.operands.get(i) {
            Some(Some(t)) => Ok(t.elem),
            _ => Err(format!(
                "operand {i} must be a ranked tensor with a static shape"
            )),
        }
    }

    /// Integer attribute `name` (or `default` when absent).
    pub fn int_or(&self, name: &str, default: i64) -> i64 {
        match self.attrs.get(name) {
            Some(AttrValue::Int(n)) => *n,
            _ => default,
        }
    }

    /// Required integer attribute.
    pub fn int(&self, name: &str) -> Result<i64, String> {
        match self.attrs.get(name) {
            Some(AttrValue::Int(n)) => Ok(*n),
            _ => Err(format!("requires integer attribute '{name}'")),
        }
    }

    /// Float attribute (integers accepted) or `default`.
    pub fn float_or(&self, name: &str, default: f64) -> f64 {
        match self.attrs.get(name) {
            Some(AttrValue::Float(x)) => *x,
            Some(AttrValue::Int(n)) => *n as f64,
            _ => default,
        }
    }

    /// Boolean attribute or `default`.
    pub fn bool_or(&self, name: &str, default: bool) -> bool {
        match self.attrs.get(name) {
            Some(AttrValue::Bool(b)) => *b,
            Some(AttrValue::Unit) => true,
            _ => default,
        }
    }

    /// String attribute or `default`.
    pub fn str_or(&self, name: &str, default: &'a str) -> &'a str {
        match self.attrs.get(name) {
            Some(AttrValue::Str(s)) => s,
            _ => default,
        }
    }

    /// Required integer-array attribute.
    pub fn ints(&self, name: &str) -> Result<&'a [i64], String> {
        match self.attrs.get(name) {
            Some(AttrValue::Ints(v)) => Ok(v),
            _ => Err(format!("requires integer array attribute '{name}'")),
        }
    }

    /// Integer array attribute `name` read as a tensor shape: every length positive and
    /// the whole no larger than the verifier's tensor limit (so products never overflow).
    pub fn shape_attr(&self, name: &str) -> Result<&'a [i64], String> {
        let v = self.ints(name)?;
        if let Some(d) = v.iter().find(|&&d| d <= 0) {
            return Err(format!("attribute '{name}' has a non-positive length {d}"));
        }
        let fits = v
            .iter()
            .try_fold(1i64, |n, &d| n.checked_mul(d))
            .is_some_and(|n| n as u64 <= crate::types::MAX_TENSOR_BYTES);
        if !fits {
            return Err(format!(
                "attribute '{name}' = {v:?} describes a tensor larger than the 2^50 elements nnscaler handles"
            ));
        }
        Ok(v)
    }

    /// Normalizes a possibly negative dimension index against `rank`.
    pub fn norm_dim(&self, dim: i64, rank: usize) -> Result<usize, String> {
        let r = rank as i64;
        let d = if dim < 0 { dim + r } else { dim };
        if d < 0 || d >= r.max(1) || (r == 0) {
            return Err(format!("dimension {dim} is out of range for rank {rank}"));
        }
        Ok(d as usize)
    }
}

/// Result-type rule: given the op, the types of its results.
pub type ResultRule = fn(&OpCtx<'_>) -> Result<Vec<TensorType>, String>;
/// Annotation rule: the op's annotation text for these operands and attributes.
pub type AnnotationRule = fn(&OpCtx<'_>) -> Result<String, String>;
/// FLOPs of one execution, given the op and its result types.
pub type FlopRule = fn(&OpCtx<'_>, &[TensorType]) -> f64;

/// In which operands an op is linear, so that partial sums may flow through it unreduced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Linearity {
    /// Not linear in any operand.
    No,
    /// Jointly linear in these operands (`add`, `sub`, `concat`): all of them partial, the
    /// others replicated.
    Joint(&'static [usize]),
    /// Linear in each of these operands (`mul`, `matmul`): exactly one partial, the others
    /// replicated.
    Each(&'static [usize]),
    /// [`Linearity::Each`] when the op has at most this many operands (`linear` without its
    /// bias), else not linear.
    EachUpTo(&'static [usize], usize),
}

impl Linearity {
    /// The linearity of an op used with `operands` operands.
    pub fn with_operands(self, operands: usize) -> Linearity {
        match self {
            Linearity::EachUpTo(set, max) if operands <= max => Linearity::Each(set),
            Linearity::EachUpTo(..) => Linearity::No,
            other => other,
        }
    }
}

/// What the passes know about an op besides its annotation, declared with the op (as MLIR
/// interfaces are), so that no pass keeps a list of op names.
#[derive(Clone, Copy, Debug)]
pub struct Traits {
    /// Where partial sums flow through it (propagation keeps them partial instead of
    /// reducing first). Norm gradients are linear in `dy` too but are left `No`: reducing
    /// `dy` before them (as Megatron does) keeps their weight gradients replicated.
    pub linear: Linearity,
    /// Its summed (`+`) dims combine across devices by maximum (`max`), not by sum.
    pub partial_max: bool,
    /// Megatron's policy lets a column-parallel result pass through it on its way to a
    /// row-parallel linear (it keeps the feature dim).
    pub megatron_through: bool,
    /// The default init of a parameter used as operand `.0`: `.1`, described as `.2` in
    /// messages (a norm's weight is ones, a bias zeros).
    pub param_init: &'static [(usize, crate::types::Init, &'static str)],
    /// What `--localize` changes in the op besides its types, for ops whose attributes
    /// spell shapes or whose kernel must know where its piece sits.
    pub localize: Option<LocalizeRule>,
    /// An optimizer op (the update after the backward): never differentiated, counted
    /// apart by `--print-stats`.
    pub optimizer: bool,
    /// An elementwise op's formula: one result element from the same element of each
    /// (broadcast) operand. Code generators fuse chains of such ops into one kernel.
    pub scalar: Option<crate::scalar::ScalarRule>,
    /// Its FLOPs are matrix products (they run at a GEMM's rate, not a vector unit's):
    /// what the cost model times by the device's matrix-product efficiency.
    pub matrix: bool,
}

/// What a localize rule sees of one op: its attributes (to change), its operands' global
/// types, its results' local types, and which mesh axes split each operand dim.
#[derive(Debug)]
pub struct LocalCtx<'a> {
    /// The op's attributes.
    pub attrs: &'a mut Attrs,
    /// Global types of the operands.
    pub operands: &'a [TensorType],
    /// Local (per-device) types of the results.
    pub results: &'a [TensorType],
    /// `split_axes[i][d]`: the names of the mesh axes splitting operand `i`'s dim `d`
    /// (outer first; empty when the dim is whole on every device).
    pub split_axes: &'a [Vec<Vec<String>>],
}

impl LocalCtx<'_> {
    /// Whether operand `i`'s dim `d` is split.
    pub fn split(&self, i: usize, d: usize) -> bool {
        self.split_axes
            .get(i)
            .and_then(|v| v.get(d))
            .is_some_and(|a| !a.is_empty())
    }

    /// The axes splitting operand `i`'s dim `d`, as a string-array attribute.
    pub fn axes(&self, i: usize, d: usize) -> AttrValue {
        AttrValue::Strs(
            self.split_axes
                .get(i)
                .and_then(|v| v.get(d))
                .cloned()
                .unwrap_or_default(),
        )
    }
}

/// A localize rule (see [`Traits::localize`]).
pub type LocalizeRule = fn(&mut LocalCtx<'_>) -> Result<(), String>;

/// The traits of an op that declares none.
pub const TRAITS: Traits = Traits {
    linear: Linearity::No,
    partial_max: false,
    megatron_through: false,
    param_init: &[],
    localize: None,
    optimizer: false,
    scalar: None,
    matrix: false,
};

/// The definition of one op.
#[derive(Debug)]
pub struct OpSpec {
    /// Full name, e.g. `dnn.matmul`.
    pub name: &'static str,
    /// One-line description.
    pub summary: &'static str,
    /// Operand names, in order.
    pub operands: &'static [&'static str],
    /// The last operand may repeat (one or more times).
    pub variadic: bool,
    /// How many trailing operands may be left out (e.g. `linear`'s bias).
    pub optional: usize,
    /// Data-movement ops take tensors of any element type (the checks below are skipped).
    pub any_elem: bool,
    /// Operand indices that must hold integers (token ids, targets); the others must be
    /// floats.
    pub int_operands: &'static [usize],
    /// Result names, in order (a variadic-result op lists one name).
    pub results: &'static [&'static str],
    /// Attributes.
    pub attrs: &'static [AttrSpec],
    /// The dim annotation for given operands.
    pub annotation: AnnotationRule,
    /// Result types; `None` derives them from the annotation, with the element type of the
    /// first float operand (or of operand 0 when none is a float).
    pub result_types: Option<ResultRule>,
    /// FLOPs of one execution.
    pub flops: FlopRule,
    /// Set for backward ops: the forward op whose gradient they compute.
    pub grad_of: Option<&'static str>,
    /// What the passes know about it besides its annotation.
    pub traits: Traits,
    /// A generic-form example, used by the docs and the round-trip tests.
    pub example: &'static str,
}

impl OpSpec {
    /// Checks operand count, element kinds and attributes, then returns the result types the
    /// op must have, and the bound annotation. Errors are messages without location.
    pub fn check(&self, ctx: &OpCtx<'_>) -> Result<(Vec<TensorType>, Annotation, Binding), String> {
        let n = ctx.operands.len();
        let want = self.operands.len();
        let min = want - self.optional;
        if (self.variadic && n < want) || (!self.variadic && (n < min || n > want)) {
            let names = self.operands.join(", ");
            let count = if self.variadic {
                format!("{want} or more")
            } else if min < want {
                format!("{min} to {want}")
            } else {
                want.to_string()
            };
            return Err(format!("expects {count} operand(s) ({names}) but has {n}"));
        }
        for (i, t) in ctx.operands.iter().enumerate() {
            let Some(t) = t else {
                return Err(format!(
                    "operand {i} ({}) must be a ranked tensor with a static shape",
                    self.operand_name(i)
                ));
            };
            if let Some(d) = t.shape.iter().find(|&&d| d <= 0) {
                return Err(format!(
                    "operand {i} ({}) has a dimension of length {d}; lengths must be positive",
                    self.operand_name(i)
                ));
            }
            if self.any_elem {
                continue;
            }
            let want_int = self.int_operands.contains(&i);
            if want_int && t.elem.is_float() {
                return Err(format!(
                    "operand {i} ({}) must hold integers, not {}",
                    self.operand_name(i),
                    t.elem
                ));
            }
            if !want_int && !t.elem.is_float() {
                return Err(format!(
                    "operand {i} ({}) must hold floats, not {}",
                    self.operand_name(i),
                    t.elem
                ));
            }
        }
        for a in self.attrs {
            match ctx.attrs.get(a.name) {
                None if a.required => {
                    return Err(format!("requires {} attribute '{}'", a.kind.name(), a.name))
                }
                Some(v) if !a.kind.accepts(v) => {
                    return Err(format!(
                        "attribute '{}' must be {} but is {}",
                        a.name,
                        a.kind.name(),
                        v.kind_name()
                    ))
                }
                _ => {}
            }
        }
        let text = (self.annotation)(ctx)?;
        let anno = Annotation::parse_cached(&text)
            .map_err(|e| format!("internal annotation '{text}' is invalid: {e}"))?;
        let shapes: Vec<Option<&[i64]>> = ctx
            .operands
            .iter()
            .map(|t| t.as_ref().map(|t| t.shape.as_slice()))
            .collect();
        let binding = anno
            .bind(&shapes)
            .map_err(|e| format!("operands do not match annotation '{anno}': {e}"))?;
        let results = match self.result_types {
            Some(rule) => rule(ctx)?,
            None => {
                let mut elems = ctx.operands.iter().flatten().map(|t| t.elem);
                let first = ctx.operands.first().cloned().flatten().map(|t| t.elem);
                let elem = elems.find(|e| e.is_float()).or(first).unwrap_or(Elem::F32);
                binding
                    .output_shapes()
                    .into_iter()
                    .map(|s| TensorType { shape: s, elem })
                    .collect()
            }
        };
        Ok((results, anno, binding))
    }

    fn operand_name(&self, i: usize) -> &'static str {
        self.operands
            .get(i)
            .or(self.operands.last())
            .copied()
            .unwrap_or("operand")
    }
}

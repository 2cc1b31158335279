//! The `dnn` dialect: compute ops on global shapes, forward and backward.
//!
//! Every op is one [`OpSpec`] in [`SPECS`]. Annotations are computed from operand ranks and
//! attributes, written in nnScaler's language (see [`crate::annotation`]).
//!
//! Ops are grouped by family, one module each holding its ops' specs (one `const` per op,
//! named after it), annotations, FLOP counts and localize rules: `linalg` (matmul,
//! linear), `elementwise` (arithmetic, activations, casts, dropout, fill), `norms`
//! (softmax, LayerNorm, RMSNorm), `shape`, `reduce`, `attention` (with rotary),
//! `tokens` (embedding and the losses over classes) and `optimizer`. This module holds
//! what they share (identifier names, attribute specs, the spec-building macros) and
//! [`SPECS`], which lists every op forward ops first, the order of the dialect reference.

use crate::spec::{AttrKind, AttrSpec, Linearity, LocalCtx, OpCtx, OpSpec, Traits, TRAITS};
use crate::types::AttrValue;
use crate::types::Init;
use crate::types::{Elem, TensorType};

const fn attr(name: &'static str, kind: AttrKind, required: bool, doc: &'static str) -> AttrSpec {
    AttrSpec {
        name,
        kind,
        required,
        doc,
    }
}

const LETTERS: &[&str] = &[
    "a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p",
];

/// Identifier for dimension `i` (`a`, `b`, ...; `x16`, ... past the alphabet slice).
fn id(i: usize) -> String {
    LETTERS
        .get(i)
        .map(|s| s.to_string())
        .unwrap_or(format!("x{i}"))
}

fn join(v: &[String]) -> String {
    v.join(" ")
}

fn numel(t: &TensorType) -> f64 {
    t.numel() as f64
}

fn out_numel(_: &OpCtx<'_>, r: &[TensorType]) -> f64 {
    r.iter().map(numel).sum()
}

fn zero_flops(_: &OpCtx<'_>, _: &[TensorType]) -> f64 {
    0.0
}

/// Elementwise ops cost a few FLOPs per output element.
macro_rules! per_elem {
    ($name:ident, $n:expr) => {
        fn $name(_: &OpCtx<'_>, r: &[TensorType]) -> f64 {
            $n * r.iter().map(numel).sum::<f64>()
        }
    };
}

per_elem!(flops_x4, 4.0);

per_elem!(flops_x8, 8.0);

per_elem!(flops_x10, 10.0);

/// Identifiers for a tensor of `rank` whose dimension `frozen` (if any) is marked `^`.
fn ids_with(rank: usize, frozen: &[usize], mark: &str) -> Vec<String> {
    (0..rank)
        .map(|i| {
            if frozen.contains(&i) {
                format!("{}{mark}", id(i))
            } else {
                id(i)
            }
        })
        .collect()
}

/// A single operand's annotation entry: its identifiers, or `?` for a scalar (an operand
/// that is never split; an empty entry would read as "no operands").
fn operand(ids: &[String]) -> String {
    if ids.is_empty() {
        "?".into()
    } else {
        join(ids)
    }
}

/// `ids` with each identifier marked `mark`.
fn marked(ids: &str, mark: &str) -> String {
    ids.split(' ')
        .map(|i| format!("{i}{mark}"))
        .collect::<Vec<_>>()
        .join(" ")
}

const EPS: AttrSpec = attr(
    "eps",
    AttrKind::Float,
    false,
    "added to the variance (default 1e-5)",
);

const DIM: AttrSpec = attr(
    "dim",
    AttrKind::Int,
    false,
    "the normalized dimension (default -1)",
);

const DIMS: AttrSpec = attr("dims", AttrKind::Ints, true, "the reduced dimensions");

const KEEPDIM: AttrSpec = attr(
    "keepdim",
    AttrKind::Bool,
    false,
    "keep reduced dims as length 1",
);

const COUNT: AttrSpec = attr(
    "count",
    AttrKind::Int,
    false,
    "divide by this many elements instead of the local count (set by --localize when the reduced dim is split)",
);

const ROW_AXES: AttrSpec = attr(
    "row_axes",
    AttrKind::Strs,
    false,
    "set by --localize: the mesh axes splitting the table's rows; ids outside this device's block give zero rows",
);

const OFFSET_AXES: AttrSpec = attr(
    "offset_axes",
    AttrKind::Strs,
    false,
    "set by --localize: the mesh axes splitting the classes; targets are global class ids",
);

const SEQ_AXES: AttrSpec = attr(
    "seq_axes",
    AttrKind::Strs,
    false,
    "set by --localize: the mesh axes splitting the positions (context parallelism); positions count from this device's block",
);

const CAUSAL: AttrSpec = attr("causal", AttrKind::Bool, false, "mask future positions");

const SCALE: AttrSpec = attr(
    "scale",
    AttrKind::Float,
    false,
    "score scale (default 1/sqrt(d))",
);

const THETA: AttrSpec = attr("theta", AttrKind::Float, false, "RoPE base (default 10000)");

const APPROX: AttrSpec = attr(
    "approximate",
    AttrKind::Str,
    false,
    "\"none\" (erf) or \"tanh\"",
);

macro_rules! elementwise {
    ($name:literal, $summary:literal, $flops:ident, $ex:literal) => {
        elementwise!($name, $summary, $flops, $ex, TRAITS)
    };
    ($name:literal, $summary:literal, $flops:ident, $ex:literal, $traits:expr) => {
        OpSpec {
            name: $name,
            summary: $summary,
            operands: &["x"],
            variadic: false,
            optional: 0,
            any_elem: false,
            int_operands: &[],
            results: &["y"],
            attrs: &[],
            annotation: unary,
            result_types: None,
            flops: $flops,
            grad_of: None,
            traits: $traits,
            example: $ex,
        }
    };
}

macro_rules! binary_op {
    ($name:literal, $summary:literal, $ex:literal) => {
        binary_op!($name, $summary, $ex, TRAITS)
    };
    ($name:literal, $summary:literal, $ex:literal, $traits:expr) => {
        OpSpec {
            name: $name,
            summary: $summary,
            operands: &["lhs", "rhs"],
            variadic: false,
            optional: 0,
            any_elem: false,
            int_operands: &[],
            results: &["out"],
            attrs: &[],
            annotation: binary,
            result_types: None,
            flops: out_numel,
            grad_of: None,
            traits: $traits,
            example: $ex,
        }
    };
}

macro_rules! act_grad {
    ($name:literal, $of:literal, $summary:literal, $rule:expr, $ex:literal) => {
        OpSpec {
            name: $name,
            summary: $summary,
            operands: &["dy", "x"],
            variadic: false,
            optional: 0,
            any_elem: false,
            int_operands: &[],
            results: &["dx"],
            attrs: &[],
            annotation: unary_grad,
            result_types: None,
            flops: flops_x8,
            grad_of: Some($of),
            traits: Traits {
                linear: Linearity::Joint(&[0]),
                scalar: Some($rule),
                ..TRAITS
            },
            example: $ex,
        }
    };
}

// --- What --localize changes besides types (`Traits::localize`). ---
/// `shape` spells the result's shape: the local one.
fn local_shape_attr(c: &mut LocalCtx<'_>) -> Result<(), String> {
    let shape = c.results[0].shape.clone();
    c.attrs.insert("shape".into(), AttrValue::Ints(shape));
    Ok(())
}

/// A mean over a split dim divides by the global count.
fn set_count(c: &mut LocalCtx<'_>, count: i64) {
    c.attrs
        .entry("count".into())
        .or_insert(AttrValue::Int(count));
}

/// Leading (batch) identifiers of a rank-`r` tensor whose last `tail` dims are named apart,
/// each marked `+` (the weight gradients sum over them).
fn summed_lead(rank: usize, tail: usize) -> Vec<String> {
    (0..rank.saturating_sub(tail))
        .map(|i| format!("{}+", id(i)))
        .collect()
}

mod attention;
mod elementwise;
mod linalg;
mod norms;
mod optimizer;
mod reduce;
mod shape;
mod tokens;

/// Every `dnn` op, forward ops first.
pub static SPECS: &[OpSpec] = &[
    linalg::MATMUL,
    linalg::LINEAR,
    elementwise::ADD,
    elementwise::SUB,
    elementwise::MUL,
    elementwise::DIV,
    elementwise::NEG,
    elementwise::ABS,
    elementwise::EXP,
    elementwise::LOG,
    elementwise::SQRT,
    elementwise::RSQRT,
    elementwise::SIGMOID,
    elementwise::TANH,
    elementwise::GELU,
    elementwise::CAST,
    elementwise::SILU,
    elementwise::RELU,
    norms::SOFTMAX,
    norms::LOG_SOFTMAX,
    norms::LAYER_NORM,
    norms::RMS_NORM,
    tokens::EMBEDDING,
    shape::RESHAPE,
    shape::TRANSPOSE,
    shape::SLICE,
    shape::CONCAT,
    shape::SPLIT,
    reduce::SUM,
    reduce::MEAN,
    reduce::MAX,
    attention::ATTENTION,
    attention::ROTARY,
    tokens::CROSS_ENTROPY,
    tokens::PICK,
    elementwise::DROPOUT,
    elementwise::FILL,
    optimizer::ADAMW,
    optimizer::CLIP_SCALE,
    elementwise::GELU_GRAD,
    elementwise::SILU_GRAD,
    elementwise::RELU_GRAD,
    elementwise::TANH_GRAD,
    norms::SOFTMAX_GRAD,
    norms::LOG_SOFTMAX_GRAD,
    norms::LAYER_NORM_GRAD,
    norms::RMS_NORM_GRAD,
    tokens::EMBEDDING_GRAD,
    linalg::LINEAR_WEIGHT_GRAD,
    attention::ATTENTION_GRAD,
    attention::ROTARY_GRAD,
    tokens::CROSS_ENTROPY_GRAD,
    tokens::PICK_GRAD,
    tokens::SOFTMAX_XENT_GRAD,
    shape::BROADCAST_TO,
    reduce::MAX_GRAD,
    shape::PAD,
];

/// Looks up a `dnn` op by full name.
pub fn spec(name: &str) -> Option<&'static OpSpec> {
    static BY_NAME: std::sync::OnceLock<std::collections::HashMap<&'static str, &'static OpSpec>> =
        std::sync::OnceLock::new();
    BY_NAME
        .get_or_init(|| SPECS.iter().rev().map(|s| (s.name, s)).collect())
        .get(name)
        .copied()
}

/// The VJP rule of forward op `op`, from its family's module (each family keeps its ops'
/// rules beside their specs); `None` for an op without one (a gradient op, an optimizer
/// update, an op of another dialect).
pub fn vjp_rule(op: &str) -> Option<crate::vjp::VjpRule> {
    linalg::vjp_rule(op)
        .or_else(|| elementwise::vjp_rule(op))
        .or_else(|| norms::vjp_rule(op))
        .or_else(|| shape::vjp_rule(op))
        .or_else(|| reduce::vjp_rule(op))
        .or_else(|| attention::vjp_rule(op))
        .or_else(|| tokens::vjp_rule(op))
}

#[cfg(test)]
mod tests {
    use super::shape::reshape_anno;
    use super::*;
    use crate::types::{AttrValue, Attrs};

    #[test]
    fn every_forward_op_has_a_vjp_rule() {
        let missing: Vec<&str> = SPECS
            .iter()
            .filter(|s| s.grad_of.is_none() && !s.traits.optimizer)
            .map(|s| s.name)
            .filter(|n| vjp_rule(n).is_none())
            .collect();
        assert!(
            missing.is_empty(),
            "forward ops without a VJP rule: {missing:?}"
        );
    }

    fn check(
        name: &str,
        shapes: &[&[i64]],
        attrs: &[(&str, AttrValue)],
    ) -> Result<Vec<Vec<i64>>, String> {
        let ops: Vec<Option<TensorType>> = shapes
            .iter()
            .map(|s| Some(TensorType::new(s, Elem::F32)))
            .collect();
        let attrs: Attrs = attrs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        let ctx = OpCtx {
            operands: &ops,
            attrs: &attrs,
        };
        let mut spec = spec(name).unwrap();
        // Integer operands are irrelevant to shapes; check them as floats via a copy.
        let tmp;
        if !spec.int_operands.is_empty() {
            tmp = OpSpec {
                int_operands: &[],
                ..*spec
            };
            spec = &tmp;
        }
        spec.check(&ctx)
            .map(|(r, _, _)| r.into_iter().map(|t| t.shape).collect())
    }

    /// An op whose attributes depend on the shapes `--localize` changes (a shape, a count
    /// over split dims, indices into a split dim, a mask over the whole tensor) must say in
    /// its spec how they change: a new op of that kind without a localize rule fails here.
    #[test]
    fn ops_with_shape_dependent_attributes_have_localize_rules() {
        for s in SPECS {
            let shapey = s.attrs.iter().any(|a| {
                matches!(
                    a.name,
                    "shape"
                        | "vocab"
                        | "count"
                        | "row_axes"
                        | "offset_axes"
                        | "global_shape"
                        | "seq_axes"
                )
            });
            assert!(
                !shapey || s.traits.localize.is_some(),
                "{} has shape-dependent attributes but no Traits::localize rule",
                s.name
            );
        }
    }

    /// Backward ops are linear in their incoming gradient (operand 0, `dy`); each says so,
    /// unless listed here with the reason.
    #[test]
    fn gradient_ops_declare_their_linearity() {
        // Norm gradients are linear in dy too, but reducing dy before them keeps their
        // weight gradients replicated (see `Traits::linear`). `softmax_xent_grad` and
        // `pick_grad` only appear in the vocabulary-parallel cross-entropy, whose dloss is
        // replicated; declaring them linear is untested, so they are left out.
        let exempt = [
            "dnn.layer_norm_grad",
            "dnn.rms_norm_grad",
            "dnn.softmax_xent_grad",
            "dnn.pick_grad",
        ];
        for s in SPECS.iter().filter(|s| s.grad_of.is_some()) {
            if exempt.contains(&s.name) {
                continue;
            }
            assert_ne!(
                s.traits.linear,
                Linearity::No,
                "{} is a gradient op without a declared linearity",
                s.name
            );
        }
    }

    #[test]
    fn matmul_shapes_and_transposes() {
        assert_eq!(
            check("dnn.matmul", &[&[4, 8], &[8, 16]], &[]),
            Ok(vec![vec![4, 16]])
        );
        assert_eq!(
            check(
                "dnn.matmul",
                &[&[2, 8, 4], &[16, 8]],
                &[
                    ("transpose_a", AttrValue::Bool(true)),
                    ("transpose_b", AttrValue::Bool(true))
                ]
            ),
            Ok(vec![vec![2, 4, 16]])
        );
        let e = check("dnn.matmul", &[&[4, 8], &[7, 16]], &[]).unwrap_err();
        assert!(
            e.contains("'k' is 8 in operand 0 dim 1 but 7 in operand 1 dim 0"),
            "{e}"
        );
    }

    #[test]
    fn broadcasting() {
        assert_eq!(
            check("dnn.add", &[&[2, 3], &[3]], &[]),
            Ok(vec![vec![2, 3]])
        );
        assert_eq!(
            check("dnn.mul", &[&[2, 1], &[1, 3]], &[]),
            Ok(vec![vec![2, 3]])
        );
        assert!(check("dnn.add", &[&[2, 3], &[4]], &[])
            .unwrap_err()
            .contains("do not broadcast"));
    }

    #[test]
    fn reshape_annotations() {
        let attrs = |s: &[i64]| vec![("shape", AttrValue::Ints(s.to_vec()))];
        assert_eq!(
            check("dnn.reshape", &[&[2, 3, 8]], &attrs(&[2, 3, 2, 4])),
            Ok(vec![vec![2, 3, 2, 4]])
        );
        assert_eq!(
            check("dnn.reshape", &[&[2, 3, 8]], &attrs(&[6, 8])),
            Ok(vec![vec![6, 8]])
        );
        assert_eq!(
            check("dnn.reshape", &[&[6, 4]], &attrs(&[4, 6])),
            Ok(vec![vec![4, 6]])
        );
        assert_eq!(
            check("dnn.reshape", &[&[1, 6]], &attrs(&[6, 1])),
            Ok(vec![vec![6, 1]])
        );
        assert!(check("dnn.reshape", &[&[6]], &attrs(&[4]))
            .unwrap_err()
            .contains("cannot reshape"));
        let ops = [Some(TensorType::new(&[2, 3, 8], Elem::F32))];
        let a: Attrs = [("shape".to_string(), AttrValue::Ints(vec![2, 3, 2, 4]))].into();
        let ctx = OpCtx {
            operands: &ops,
            attrs: &a,
        };
        assert_eq!(reshape_anno(&ctx).unwrap(), "r0 r1 (r2 4) -> r0 r1 r2 4");
        let anno = |from: &[i64], to: &[i64]| {
            let ops = [Some(TensorType::new(from, Elem::F32))];
            let a: Attrs = [("shape".to_string(), AttrValue::Ints(to.to_vec()))].into();
            reshape_anno(&OpCtx {
                operands: &ops,
                attrs: &a,
            })
            .unwrap()
        };
        // Regrouped factors share their outermost common factor.
        assert_eq!(anno(&[8, 6], &[4, 12]), "(r0 2) r1^ -> r0 12");
        assert_eq!(anno(&[4, 12], &[8, 6]), "r0 r1^ -> (r0 2) 6");
        assert_eq!(anno(&[6, 4], &[4, 6]), "(r0 3) r1^ -> (r0 2) 6");
        assert_eq!(anno(&[2, 8, 6], &[2, 4, 12]), "r0 (r1 2) r2^ -> r0 r1 12");
        // Nothing in common: frozen.
        assert_eq!(anno(&[3, 4], &[2, 6]), "r0^ r1^ -> 2 6");
    }

    #[test]
    fn gqa_attention() {
        assert_eq!(
            check(
                "dnn.attention",
                &[&[1, 8, 16, 4], &[1, 2, 16, 4], &[1, 2, 16, 4]],
                &[]
            ),
            Ok(vec![vec![1, 8, 16, 4]])
        );
        assert!(check(
            "dnn.attention",
            &[&[1, 6, 16, 4], &[1, 4, 16, 4], &[1, 4, 16, 4]],
            &[]
        )
        .is_err());
    }
}

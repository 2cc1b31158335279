//! Elementwise ops: unary and binary arithmetic (numpy broadcasting), activations and
//! their gradients, casts, dropout and fill.

use super::*;
use crate::vjp::VjpRule;

pub(super) fn unary(_: &OpCtx<'_>) -> Result<String, String> {
    Ok("* -> *".into())
}

pub(super) fn unary_grad(_: &OpCtx<'_>) -> Result<String, String> {
    Ok("*, * -> *".into())
}

/// Numpy broadcasting of two shapes.
pub(super) fn broadcast(a: &[i64], b: &[i64]) -> Result<Vec<i64>, String> {
    let r = a.len().max(b.len());
    let mut out = vec![0; r];
    for i in 0..r {
        let x = if i + a.len() >= r {
            a[i + a.len() - r]
        } else {
            1
        };
        let y = if i + b.len() >= r {
            b[i + b.len() - r]
        } else {
            1
        };
        out[i] = match (x, y) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(format!(
                    "shapes {a:?} and {b:?} do not broadcast: dimension {i} of the result would be {x} and {y}"
                ))
            }
        };
    }
    Ok(out)
}

pub(super) fn binary(ctx: &OpCtx<'_>) -> Result<String, String> {
    let (a, b) = (ctx.shape(0)?, ctx.shape(1)?);
    let out = broadcast(a, b)?;
    let r = out.len();
    let side = |s: &[i64]| -> String {
        let mut v = Vec::new();
        for (k, &len) in s.iter().enumerate() {
            let o = k + r - s.len();
            v.push(if len == 1 && out[o] != 1 {
                "1".into()
            } else {
                id(o)
            });
        }
        join(&v)
    };
    let outs: Vec<String> = (0..r).map(id).collect();
    Ok(format!("{}, {} -> {}", side(a), side(b), join(&outs)))
}

pub(super) fn dropout_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let p = ctx.float_or("p", 0.0);
    if !(0.0..1.0).contains(&p) {
        return Err(format!("attribute 'p' must be in [0, 1), got {p}"));
    }
    if ctx.operands.len() == 2 {
        if ctx.rank(1)? != 0 {
            return Err("operand 1 (the step) must be a scalar".into());
        }
        return Ok("*,  -> *".into());
    }
    Ok("* -> *".into())
}

pub(super) fn fill_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let shape = ctx.shape_attr("shape")?;
    let v: Vec<String> = shape.iter().map(i64::to_string).collect();
    Ok(format!(" -> {}", join(&v)))
}

pub(super) fn fill_results(ctx: &OpCtx<'_>) -> Result<Vec<TensorType>, String> {
    let dtype = ctx.str_or("dtype", "f32");
    let elem = Elem::parse(dtype).ok_or(format!("unknown dtype '{dtype}'"))?;
    Ok(vec![TensorType::new(ctx.shape_attr("shape")?, elem)])
}

/// `dnn.cast`: the operand's shape, the element type `to` names (f32 or bf16: f16 would
/// need loss scaling, which nnscaler does not do).
pub(super) fn cast_types(ctx: &OpCtx<'_>) -> Result<Vec<TensorType>, String> {
    let to = ctx.str_or("to", "");
    let elem = match Elem::parse(to) {
        Some(e @ (Elem::F32 | Elem::BF16)) => e,
        _ => {
            return Err(format!(
                "attribute 'to' must be \"f32\" or \"bf16\", got \"{to}\""
            ))
        }
    };
    Ok(vec![TensorType {
        shape: ctx.shape(0)?.to_vec(),
        elem,
    }])
}

pub(super) fn gelu_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    match ctx.str_or("approximate", "none") {
        "none" | "tanh" => Ok("* -> *".into()),
        other => Err(format!(
            "attribute 'approximate' must be \"none\" or \"tanh\", got \"{other}\""
        )),
    }
}

pub(super) fn gelu_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    gelu_anno(ctx).map(|_| "*, * -> *".into())
}

/// The mask is indexed by the element's place in the whole tensor.
pub(super) fn local_dropout(c: &mut LocalCtx<'_>) -> Result<(), String> {
    let rank = c.operands[0].rank();
    if (0..rank).any(|d| c.split(0, d)) {
        let axes: Vec<String> = (0..rank)
            .map(|d| match c.axes(0, d) {
                AttrValue::Strs(v) => v.join(","),
                _ => String::new(),
            })
            .collect();
        let shape = c.operands[0].shape.clone();
        c.attrs
            .insert("global_shape".into(), AttrValue::Ints(shape));
        c.attrs.insert("dim_axes".into(), AttrValue::Strs(axes));
    }
    Ok(())
}

pub(super) const ADD: OpSpec = binary_op!(
    "dnn.add",
    "Elementwise sum with broadcasting",
    r#"%2 = "dnn.add"(%0, %1) : (tensor<2x3xf32>, tensor<3xf32>) -> tensor<2x3xf32>"#,
    Traits {
        linear: Linearity::Joint(&[0, 1]),
        scalar: Some(&formulas::Add),
        ..TRAITS
    }
);

pub(super) const SUB: OpSpec = binary_op!(
    "dnn.sub",
    "Elementwise difference with broadcasting",
    r#"%2 = "dnn.sub"(%0, %1) : (tensor<2x3xf32>, tensor<2x1xf32>) -> tensor<2x3xf32>"#,
    Traits {
        linear: Linearity::Joint(&[0, 1]),
        scalar: Some(&formulas::Sub),
        ..TRAITS
    }
);

pub(super) const MUL: OpSpec = binary_op!(
    "dnn.mul",
    "Elementwise product with broadcasting",
    r#"%2 = "dnn.mul"(%0, %1) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>"#,
    Traits {
        linear: Linearity::Each(&[0, 1]),
        megatron_through: true,
        scalar: Some(&formulas::Mul),
        ..TRAITS
    }
);

pub(super) const DIV: OpSpec = binary_op!(
    "dnn.div",
    "Elementwise quotient with broadcasting",
    r#"%2 = "dnn.div"(%0, %1) : (tensor<2x3xf32>, tensor<f32>) -> tensor<2x3xf32>"#,
    Traits {
        linear: Linearity::Joint(&[0]),
        scalar: Some(&formulas::Div),
        ..TRAITS
    }
);

pub(super) const NEG: OpSpec = elementwise!(
    "dnn.neg",
    "-x",
    out_numel,
    r#"%1 = "dnn.neg"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
    Traits {
        linear: Linearity::Joint(&[0]),
        scalar: Some(&formulas::Neg),
        ..TRAITS
    }
);

pub(super) const ABS: OpSpec = elementwise!(
    "dnn.abs",
    "|x|",
    out_numel,
    r#"%1 = "dnn.abs"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
    Traits {
        megatron_through: true,
        scalar: Some(&formulas::Abs),
        ..TRAITS
    }
);

pub(super) const EXP: OpSpec = elementwise!(
    "dnn.exp",
    "e^x",
    flops_x4,
    r#"%1 = "dnn.exp"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
    Traits {
        scalar: Some(&formulas::Exp),
        ..TRAITS
    }
);

pub(super) const LOG: OpSpec = elementwise!(
    "dnn.log",
    "Natural logarithm",
    flops_x4,
    r#"%1 = "dnn.log"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
    Traits {
        scalar: Some(&formulas::Log),
        ..TRAITS
    }
);

pub(super) const SQRT: OpSpec = elementwise!(
    "dnn.sqrt",
    "Square root",
    flops_x4,
    r#"%1 = "dnn.sqrt"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
    Traits {
        scalar: Some(&formulas::Sqrt),
        ..TRAITS
    }
);

pub(super) const RSQRT: OpSpec = elementwise!(
    "dnn.rsqrt",
    "1 / sqrt(x)",
    flops_x4,
    r#"%1 = "dnn.rsqrt"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
    Traits {
        scalar: Some(&formulas::Rsqrt),
        ..TRAITS
    }
);

pub(super) const SIGMOID: OpSpec = elementwise!(
    "dnn.sigmoid",
    "1 / (1 + e^-x)",
    flops_x4,
    r#"%1 = "dnn.sigmoid"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
    Traits {
        megatron_through: true,
        scalar: Some(&formulas::Sigmoid),
        ..TRAITS
    }
);

pub(super) const TANH: OpSpec = elementwise!(
    "dnn.tanh",
    "Hyperbolic tangent",
    flops_x4,
    r#"%1 = "dnn.tanh"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
    Traits {
        megatron_through: true,
        scalar: Some(&formulas::Tanh),
        ..TRAITS
    }
);

pub(super) const GELU: OpSpec = OpSpec {
    name: "dnn.gelu",
    summary: "Gaussian error linear unit",
    operands: &["x"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["y"],
    attrs: &[APPROX],
    annotation: gelu_anno,
    result_types: None,
    flops: flops_x8,
    grad_of: None,
    traits: Traits {
        megatron_through: true,
        scalar: Some(&formulas::Gelu),
        ..TRAITS
    },
    example: r#"%1 = "dnn.gelu"(%0) {approximate = "tanh"} : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
};

pub(super) const CAST: OpSpec = OpSpec {
    name: "dnn.cast",
    summary: "Converts floats to another float type: to bf16 rounds to nearest (ties to even), to f32 is exact; what --autocast inserts around matrix products",
    operands: &["x"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["y"],
    attrs: &[attr("to", AttrKind::Str, true, "the result's element type: \"f32\" or \"bf16\"")],
    annotation: unary,
    result_types: Some(cast_types),
    flops: out_numel,
    grad_of: None,
    traits: Traits {
        // Exact to f32 (every bf16 is an f32), so partial sums pass through it and are
        // reduced (or accumulated over micro-batches) in f32; to bf16 it rounds each
        // partial, as a bf16 product already does.
        linear: Linearity::Each(&[0]),
        megatron_through: true,
        scalar: Some(&formulas::Cast),
        ..TRAITS
    },
    example: r#"%1 = "dnn.cast"(%0) {to = "bf16"} : (tensor<2x3xf32>) -> tensor<2x3xbf16>"#,
};

pub(super) const SILU: OpSpec = elementwise!(
    "dnn.silu",
    "x * sigmoid(x)",
    flops_x4,
    r#"%1 = "dnn.silu"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
    Traits {
        megatron_through: true,
        scalar: Some(&formulas::Silu),
        ..TRAITS
    }
);

pub(super) const RELU: OpSpec = elementwise!(
    "dnn.relu",
    "max(x, 0)",
    out_numel,
    r#"%1 = "dnn.relu"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
    Traits {
        megatron_through: true,
        scalar: Some(&formulas::Relu),
        ..TRAITS
    }
);

pub(super) const DROPOUT: OpSpec = OpSpec {
    name: "dnn.dropout",
    summary: "Zeroes elements with probability p and scales the rest by 1/(1-p); the mask is a function of (seed, element index), and of the training step when the optional scalar step is given (a new mask each step)",
    operands: &["x", "step"],
    variadic: false,
    optional: 1,
    any_elem: false,
    int_operands: &[],
    results: &["y"],
    attrs: &[
        attr("p", AttrKind::Float, true, "drop probability in [0, 1)"),
        attr("seed", AttrKind::Int, true, "mask seed"),
        attr("global_shape", AttrKind::Ints, false, "set by --localize on a shard: the whole tensor's shape (the mask is indexed globally)"),
        attr("dim_axes", AttrKind::Strs, false, "set by --localize on a shard: per dim, the comma-separated mesh axes splitting it"),
    ],
    annotation: dropout_anno,
    result_types: None,
    flops: flops_x4,
    grad_of: None,
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        megatron_through: true,
        localize: Some(local_dropout),
        ..TRAITS
    },
    example: r#"%1 = "dnn.dropout"(%0) {p = 1.0e-1 : f64, seed = 7 : i64} : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
};

pub(super) const FILL: OpSpec = OpSpec {
    name: "dnn.fill",
    summary: "A tensor with every element equal to value",
    operands: &[],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["y"],
    attrs: &[
        attr("shape", AttrKind::Ints, true, "the shape"),
        attr("value", AttrKind::Float, true, "the element value"),
        attr(
            "dtype",
            AttrKind::Str,
            false,
            "element type (default \"f32\")",
        ),
    ],
    annotation: fill_anno,
    result_types: Some(fill_results),
    flops: zero_flops,
    grad_of: None,
    traits: Traits {
        localize: Some(local_shape_attr),
        ..TRAITS
    },
    example: r#"%0 = "dnn.fill"() {shape = array<i64: 2, 3>, value = 1.0 : f64} : () -> tensor<2x3xf32>"#,
};

pub(super) const GELU_GRAD: OpSpec = OpSpec {
    name: "dnn.gelu_grad",
    summary: "dy * gelu'(x)",
    operands: &["dy", "x"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["dx"],
    attrs: &[APPROX],
    annotation: gelu_grad_anno,
    result_types: None,
    flops: flops_x10,
    grad_of: Some("dnn.gelu"),
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        scalar: Some(&formulas::GeluGrad),
        ..TRAITS
    },
    example: r#"%2 = "dnn.gelu_grad"(%0, %1) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>"#,
};

pub(super) const SILU_GRAD: OpSpec = act_grad!(
    "dnn.silu_grad",
    "dnn.silu",
    "dy * silu'(x)",
    &formulas::SiluGrad,
    r#"%2 = "dnn.silu_grad"(%0, %1) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>"#
);

pub(super) const RELU_GRAD: OpSpec = act_grad!(
    "dnn.relu_grad",
    "dnn.relu",
    "dy where x > 0, else 0",
    &formulas::ReluGrad,
    r#"%2 = "dnn.relu_grad"(%0, %1) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>"#
);

pub(super) const TANH_GRAD: OpSpec = OpSpec {
    name: "dnn.tanh_grad",
    summary: "dy * (1 - y^2), given the forward output y",
    operands: &["dy", "y"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["dx"],
    attrs: &[],
    annotation: unary_grad,
    result_types: None,
    flops: flops_x4,
    grad_of: Some("dnn.tanh"),
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        scalar: Some(&formulas::TanhGrad),
        ..TRAITS
    },
    example: r#"%2 = "dnn.tanh_grad"(%0, %1) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>"#,
};

/// The ops' formulas ([`Elementwise`]): each written once, generic over [`Scalar`], for the
/// code generators (as an [`crate::scalar::Expr`]) and the CPU runtime (in f32).
pub mod formulas {
    use crate::scalar::{Elementwise, Scalar};
    use crate::types::{AttrValue, Attrs};

    /// A formula without attributes: `formula!(Name, arity, |x| body)`, `x` the operands.
    macro_rules! formula {
        ($(#[$doc:meta])* $name:ident, $arity:literal, |$x:ident| $body:expr) => {
            $(#[$doc])*
            pub struct $name;
            impl Elementwise for $name {
                const ARITY: usize = $arity;
                #[inline(always)]
                fn formula<T: Scalar>(_: usize, $x: &[T]) -> T {
                    $body
                }
            }
        };
    }

    #[inline(always)]
    fn c<T: Scalar>(v: f32) -> T {
        T::c(v)
    }

    #[inline(always)]
    fn sigmoid<T: Scalar>(v: T) -> T {
        c::<T>(1.0) / (c::<T>(1.0) + (-v).exp())
    }

    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const GELU_C: f32 = 0.044_715;
    const INV_SQRT_2PI: f32 = 0.398_942_3;

    formula!(
        /// `dnn.add`.
        Add, 2, |x| x[0].clone() + x[1].clone()
    );
    formula!(
        /// `dnn.sub`.
        Sub, 2, |x| x[0].clone() - x[1].clone()
    );
    formula!(
        /// `dnn.mul`.
        Mul, 2, |x| x[0].clone() * x[1].clone()
    );
    formula!(
        /// `dnn.div`.
        Div, 2, |x| x[0].clone() / x[1].clone()
    );
    formula!(
        /// `dnn.neg`.
        Neg, 1, |x| -x[0].clone()
    );
    formula!(
        /// `dnn.exp`.
        Exp, 1, |x| x[0].clone().exp()
    );
    formula!(
        /// `dnn.log`.
        Log, 1, |x| x[0].clone().ln()
    );
    formula!(
        /// `dnn.sqrt`.
        Sqrt, 1, |x| x[0].clone().sqrt()
    );
    formula!(
        /// `dnn.rsqrt`.
        Rsqrt, 1, |x| c::<T>(1.0) / x[0].clone().sqrt()
    );
    formula!(
        /// `dnn.sigmoid`.
        Sigmoid, 1, |x| sigmoid(x[0].clone())
    );
    formula!(
        /// `dnn.tanh`.
        Tanh, 1, |x| x[0].clone().tanh()
    );
    formula!(
        /// `dnn.relu`.
        Relu, 1, |x| x[0].clone().max(c(0.0))
    );
    formula!(
        /// `dnn.silu`.
        Silu, 1, |x| x[0].clone() * sigmoid(x[0].clone())
    );
    formula!(
        /// `dnn.abs`.
        Abs, 1, |x| x[0].clone().abs()
    );
    formula!(
        /// `dnn.silu_grad` (operands dy, x).
        SiluGrad, 2, |x| {
            let (d, p) = (x[0].clone(), x[1].clone());
            let s = sigmoid(p.clone());
            d * s.clone() * (c::<T>(1.0) + p * (c::<T>(1.0) - s))
        }
    );
    formula!(
        /// `dnn.relu_grad` (operands dy, x).
        ReluGrad, 2, |x| x[1].clone().if_gt(c(0.0), x[0].clone(), c(0.0))
    );
    formula!(
        /// `dnn.tanh_grad` (operands dy, y).
        TanhGrad, 2, |x| x[0].clone() * (c::<T>(1.0) - x[1].clone() * x[1].clone())
    );

    /// `dnn.cast`: to bf16 rounds; to f32 is exact (every bf16 is an f32).
    pub struct Cast;
    impl Elementwise for Cast {
        const ARITY: usize = 1;
        /// 0: to f32, 1: to bf16.
        fn form(a: &Attrs) -> Result<usize, String> {
            match a.get("to") {
                Some(AttrValue::Str(t)) if t == "bf16" => Ok(1),
                Some(AttrValue::Str(t)) if t == "f32" => Ok(0),
                other => Err(format!(
                    "attribute 'to' must be \"f32\" or \"bf16\", got {other:?}"
                )),
            }
        }
        #[inline(always)]
        fn formula<T: Scalar>(form: usize, x: &[T]) -> T {
            if form == 1 {
                x[0].clone().round_bf16()
            } else {
                x[0].clone()
            }
        }
    }

    /// gelu's form: 0 the erf form, 1 `approximate = "tanh"`.
    fn gelu_form(a: &Attrs) -> Result<usize, String> {
        match a.get("approximate") {
            None => Ok(0),
            Some(AttrValue::Str(s)) if s == "none" => Ok(0),
            Some(AttrValue::Str(s)) if s == "tanh" => Ok(1),
            Some(other) => Err(format!(
                "attribute 'approximate' must be \"none\" or \"tanh\", got {other:?}"
            )),
        }
    }

    /// `dnn.gelu` (erf form, or `approximate = "tanh"`).
    pub struct Gelu;
    impl Elementwise for Gelu {
        const ARITY: usize = 1;
        fn form(a: &Attrs) -> Result<usize, String> {
            gelu_form(a)
        }
        #[inline(always)]
        fn formula<T: Scalar>(form: usize, x: &[T]) -> T {
            let p = x[0].clone();
            if form == 1 {
                c::<T>(0.5)
                    * p.clone()
                    * (c::<T>(1.0)
                        + (c::<T>(SQRT_2_OVER_PI)
                            * (p.clone() + c::<T>(GELU_C) * p.clone() * p.clone() * p))
                            .tanh())
            } else {
                c::<T>(0.5)
                    * p.clone()
                    * (c::<T>(1.0) + (p * c::<T>(std::f32::consts::FRAC_1_SQRT_2)).erf())
            }
        }
    }

    /// `dnn.gelu_grad` (operands dy, x).
    pub struct GeluGrad;
    impl Elementwise for GeluGrad {
        const ARITY: usize = 2;
        fn form(a: &Attrs) -> Result<usize, String> {
            gelu_form(a)
        }
        #[inline(always)]
        fn formula<T: Scalar>(form: usize, x: &[T]) -> T {
            let (d, p) = (x[0].clone(), x[1].clone());
            if form == 1 {
                let t = (c::<T>(SQRT_2_OVER_PI)
                    * (p.clone() + c::<T>(GELU_C) * p.clone() * p.clone() * p.clone()))
                .tanh();
                let du = c::<T>(SQRT_2_OVER_PI)
                    * (c::<T>(1.0) + c::<T>(3.0 * GELU_C) * p.clone() * p.clone());
                d * (c::<T>(0.5) * (c::<T>(1.0) + t.clone())
                    + c::<T>(0.5) * p * (c::<T>(1.0) - t.clone() * t) * du)
            } else {
                let u = p.clone() * c::<T>(std::f32::consts::FRAC_1_SQRT_2);
                // exp(-u^2) written as erf computes it internally (-(|u| * |u|)), so that
                // a compiler sees one exponential where both are inlined (in f32 the loop
                // then vectorizes; with two it does not).
                let g = (-(u.clone().abs() * u.clone().abs())).exp();
                d * (c::<T>(0.5) * (c::<T>(1.0) + u.erf()) + p * c::<T>(INV_SQRT_2PI) * g)
            }
        }
    }
}

/// The VJP rules of the elementwise ops, dropout and fill.
pub(super) fn vjp_rule(op: &str) -> Option<VjpRule> {
    Some(match op {
        "dnn.add" => |c| {
            let d = c.dy(0)?;
            let (a, b) = (c.shape(c.x(0)), c.shape(c.x(1)));
            Ok(vec![Some(c.sum_to(d, &a)?), Some(c.sum_to(d, &b)?)])
        },
        "dnn.sub" => |c| {
            let d = c.dy(0)?;
            let (a, b) = (c.shape(c.x(0)), c.shape(c.x(1)));
            let nd = c.emit("dnn.neg", &[d], &[])?;
            Ok(vec![Some(c.sum_to(d, &a)?), Some(c.sum_to(nd, &b)?)])
        },
        "dnn.mul" => |c| {
            let d = c.dy(0)?;
            let (x0, x1) = (c.x(0), c.x(1));
            let mut out = vec![None, None];
            if c.needs[0] {
                let g = c.emit("dnn.mul", &[d, x1], &[])?;
                out[0] = Some(c.sum_to(g, &c.shape(x0))?);
            }
            if c.needs[1] {
                let g = c.emit("dnn.mul", &[d, x0], &[])?;
                out[1] = Some(c.sum_to(g, &c.shape(x1))?);
            }
            Ok(out)
        },
        "dnn.div" => |c| {
            let d = c.dy(0)?;
            let (x0, x1, y) = (c.x(0), c.x(1), c.y(0));
            let mut out = vec![None, None];
            if c.needs[0] {
                let g = c.emit("dnn.div", &[d, x1], &[])?;
                out[0] = Some(c.sum_to(g, &c.shape(x0))?);
            }
            if c.needs[1] {
                // d(a/b)/db = -(a/b)/b = -y/b
                let dy_y = c.emit("dnn.mul", &[d, y], &[])?;
                let q = c.emit("dnn.div", &[dy_y, x1], &[])?;
                let g = c.emit("dnn.neg", &[q], &[])?;
                out[1] = Some(c.sum_to(g, &c.shape(x1))?);
            }
            Ok(out)
        },
        "dnn.neg" => |c| {
            let d = c.dy(0)?;
            Ok(vec![Some(c.emit("dnn.neg", &[d], &[])?)])
        },
        "dnn.exp" => |c| {
            let (d, y) = (c.dy(0)?, c.y(0));
            Ok(vec![Some(c.emit("dnn.mul", &[d, y], &[])?)])
        },
        "dnn.log" => |c| {
            let (d, x) = (c.dy(0)?, c.x(0));
            Ok(vec![Some(c.emit("dnn.div", &[d, x], &[])?)])
        },
        "dnn.sqrt" => |c| {
            // dy / (2 sqrt(x))
            let (d, y) = (c.dy(0)?, c.y(0));
            let q = c.emit("dnn.div", &[d, y], &[])?;
            Ok(vec![Some(c.scale(q, 0.5)?)])
        },
        "dnn.rsqrt" => |c| {
            // d x^(-1/2) = -1/2 x^(-3/2) = -1/2 y / x
            let (d, x, y) = (c.dy(0)?, c.x(0), c.y(0));
            let p = c.emit("dnn.mul", &[d, y], &[])?;
            let q = c.emit("dnn.div", &[p, x], &[])?;
            Ok(vec![Some(c.scale(q, -0.5)?)])
        },
        "dnn.sigmoid" => |c| {
            // dy * y * (1 - y) = dy * y - (dy * y) * y
            let (d, y) = (c.dy(0)?, c.y(0));
            let p = c.emit("dnn.mul", &[d, y], &[])?;
            let q = c.emit("dnn.mul", &[p, y], &[])?;
            Ok(vec![Some(c.emit("dnn.sub", &[p, q], &[])?)])
        },
        "dnn.tanh" => |c| {
            let (d, y) = (c.dy(0)?, c.y(0));
            Ok(vec![Some(c.emit("dnn.tanh_grad", &[d, y], &[])?)])
        },
        "dnn.cast" => |c| {
            // The gradient goes back to the operand's type (bf16 gradients of a bf16 value
            // become f32 at the f32 value it was cast from).
            let d = c.dy(0)?;
            let to = c.g.value(c.x(0)).elem.to_string();
            Ok(vec![Some(c.emit(
                "dnn.cast",
                &[d],
                &[("to", AttrValue::Str(to))],
            )?)])
        },
        "dnn.gelu" => |c| {
            let (d, x) = (c.dy(0)?, c.x(0));
            let a = c.keep(&["approximate"]);
            Ok(vec![Some(c.emit("dnn.gelu_grad", &[d, x], &a)?)])
        },
        "dnn.silu" => |c| {
            let (d, x) = (c.dy(0)?, c.x(0));
            Ok(vec![Some(c.emit("dnn.silu_grad", &[d, x], &[])?)])
        },
        "dnn.abs" => |c| {
            // dy * sign(x) (0 at 0, as torch): dy where x > 0, minus dy where -x > 0.
            let (d, x) = (c.dy(0)?, c.x(0));
            let pos = c.emit("dnn.relu_grad", &[d, x], &[])?;
            let nx = c.emit("dnn.neg", &[x], &[])?;
            let neg = c.emit("dnn.relu_grad", &[d, nx], &[])?;
            Ok(vec![Some(c.emit("dnn.sub", &[pos, neg], &[])?)])
        },
        "dnn.relu" => |c| {
            let (d, x) = (c.dy(0)?, c.x(0));
            Ok(vec![Some(c.emit("dnn.relu_grad", &[d, x], &[])?)])
        },
        "dnn.dropout" => |c| {
            // The mask is a function of (seed, index): dropout of dy with the same seed
            // applies exactly the forward mask and scale.
            // With the step operand, the backward reads the same step (no gradient to it).
            let d = c.dy(0)?;
            let a = c.keep(&["p", "seed"]);
            let mut ins = vec![d];
            if c.node.inputs.len() == 2 {
                ins.push(c.x(1));
                return Ok(vec![Some(c.emit("dnn.dropout", &ins, &a)?), None]);
            }
            Ok(vec![Some(c.emit("dnn.dropout", &ins, &a)?)])
        },
        "dnn.fill" => |_| Ok(vec![]),
        _ => return None,
    })
}

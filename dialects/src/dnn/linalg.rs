//! Matrix products: `matmul`, `linear` and the weight gradient of `linear`.

use super::*;
use crate::types::ValueId;
use crate::vjp::{VjpCtx, VjpRule};

pub(super) fn matmul_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let (a, b) = (ctx.shape(0)?, ctx.shape(1)?);
    if a.len() < 2 || b.len() < 2 {
        return Err(format!(
            "operands must have rank >= 2, got {} and {}",
            a.len(),
            b.len()
        ));
    }
    let batch = a.len() - 2;
    if b.len() != 2 && b.len() != a.len() {
        return Err(format!(
            "rhs must have rank 2 or the lhs rank ({}), got {}",
            a.len(),
            b.len()
        ));
    }
    let bids: Vec<String> = (0..batch).map(|i| format!("b{i}")).collect();
    let pre = |v: &[String]| {
        if v.is_empty() {
            String::new()
        } else {
            format!("{} ", join(v))
        }
    };
    let lhs = if ctx.bool_or("transpose_a", false) {
        "k+ m"
    } else {
        "m k+"
    };
    let rhs = if ctx.bool_or("transpose_b", false) {
        "n k+"
    } else {
        "k+ n"
    };
    let rb = if b.len() == 2 {
        String::new()
    } else {
        pre(&bids)
    };
    Ok(format!(
        "{}{lhs}, {rb}{rhs} -> {}m n",
        pre(&bids),
        pre(&bids)
    ))
}

pub(super) fn matmul_flops(ctx: &OpCtx<'_>, r: &[TensorType]) -> f64 {
    let a = ctx.shape(0).unwrap_or(&[]);
    let k = if ctx.bool_or("transpose_a", false) {
        a.get(a.len().wrapping_sub(2))
    } else {
        a.last()
    };
    2.0 * numel(&r[0]) * k.copied().unwrap_or(1) as f64
}

pub(super) fn linear_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    Ok(if ctx.operands.len() == 3 {
        "* k+, n k+, n -> * n".into()
    } else {
        "* k+, n k+ -> * n".into()
    })
}

/// `dW = sum over the leading dims of dy^T x`: `a+ b+ n, a+ b+ k -> n k`. The leading dims
/// stay named, so a split of any of them (the batch over `dp`, the positions over `sp`)
/// leaves the weight gradient partial, to be reduced like `dp`'s.
pub(super) fn linear_weight_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let (r, rx) = (ctx.rank(0)?, ctx.rank(1)?);
    if r != rx || r == 0 {
        return Err(format!(
            "dy and x must have the same rank >= 1, got {r} and {rx}"
        ));
    }
    if r > 11 {
        return Err(format!("rank {r} is above the 11 this op names"));
    }
    let lead = summed_lead(r, 1);
    let pre = if lead.is_empty() {
        String::new()
    } else {
        format!("{} ", join(&lead))
    };
    Ok(format!("{pre}n, {pre}k -> n k"))
}

pub(super) fn linear_weight_grad_flops(ctx: &OpCtx<'_>, r: &[TensorType]) -> f64 {
    let rows = ctx
        .shape(0)
        .ok()
        .map(|s| s[..s.len().saturating_sub(1)].iter().product::<i64>())
        .unwrap_or(1);
    2.0 * numel(&r[0]) * rows as f64
}

pub(super) fn linear_flops(ctx: &OpCtx<'_>, r: &[TensorType]) -> f64 {
    let k = ctx
        .shape(0)
        .ok()
        .and_then(|s| s.last().copied())
        .unwrap_or(1);
    2.0 * numel(&r[0]) * k as f64
}

pub(super) const MATMUL: OpSpec = OpSpec {
    name: "dnn.matmul",
    summary: "Matrix product with optional batch dims and transposed operands",
    operands: &["lhs", "rhs"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["out"],
    attrs: &[
        attr(
            "transpose_a",
            AttrKind::Bool,
            false,
            "use lhs transposed (last two dims)",
        ),
        attr(
            "transpose_b",
            AttrKind::Bool,
            false,
            "use rhs transposed (last two dims)",
        ),
    ],
    annotation: matmul_anno,
    result_types: None,
    flops: matmul_flops,
    grad_of: None,
    traits: Traits {
        linear: Linearity::Each(&[0, 1]),
        matrix: true,
        ..TRAITS
    },
    example: r#"%2 = "dnn.matmul"(%0, %1) : (tensor<4x8xf32>, tensor<8x16xf32>) -> tensor<4x16xf32>"#,
};

pub(super) const LINEAR: OpSpec = OpSpec {
    name: "dnn.linear",
    summary: "x @ weight^T (+ bias), weight stored [out, in] as in PyTorch",
    operands: &["x", "weight", "bias"],
    variadic: false,
    optional: 1,
    any_elem: false,
    int_operands: &[],
    results: &["y"],
    attrs: &[],
    annotation: linear_anno,
    result_types: None,
    flops: linear_flops,
    grad_of: None,
    traits: Traits {
        linear: Linearity::EachUpTo(&[0, 1], 2),
        param_init: &[(2, Init::Const(0.0), "bias")],
        matrix: true,
        ..TRAITS
    },
    example: r#"%3 = "dnn.linear"(%0, %1, %2) : (tensor<2x3x8xf32>, tensor<16x8xf32>, tensor<16xf32>) -> tensor<2x3x16xf32>"#,
};

pub(super) const LINEAR_WEIGHT_GRAD: OpSpec = OpSpec {
    name: "dnn.linear_weight_grad",
    summary: "Linear backward for the weight: dy^T x summed over the leading dims, [out, in]",
    operands: &["dy", "x"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["dweight"],
    attrs: &[],
    annotation: linear_weight_grad_anno,
    result_types: None,
    flops: linear_weight_grad_flops,
    grad_of: Some("dnn.linear"),
    traits: Traits {
        linear: Linearity::Each(&[0, 1]),
        matrix: true,
        ..TRAITS
    },
    example: r#"%2 = "dnn.linear_weight_grad"(%0, %1) : (tensor<2x3x16xf32>, tensor<2x3x8xf32>) -> tensor<16x8xf32>"#,
};

/// The VJP rules of the matrix products.
pub(super) fn vjp_rule(op: &str) -> Option<VjpRule> {
    Some(match op {
        "dnn.matmul" => matmul,
        "dnn.linear" => linear,
        _ => return None,
    })
}

fn matmul(c: &mut VjpCtx<'_>) -> Result<Vec<Option<ValueId>>, String> {
    let d = c.dy(0)?;
    let (a, b) = (c.x(0), c.x(1));
    let flag = |k: &str| crate::types::flag(&c.node.attrs, k);
    let (ta, tb) = (flag("transpose_a"), flag("transpose_b"));
    let (sa, sb) = (c.shape(a), c.shape(b));
    let batch = sa.len() - 2;
    let mut out = vec![None, None];
    if c.needs[0] {
        // dA_eff = dY · B_eff^T
        let g = c.emit(
            "dnn.matmul",
            &[d, b],
            &[("transpose_b", AttrValue::Bool(!tb))],
        )?;
        out[0] = Some(if ta { c.swap_last(g)? } else { g });
    }
    if c.needs[1] {
        // dB_eff = A_eff^T · dY, summed over batch dims when B is shared
        let g = if sb.len() == 2 && batch > 0 {
            if ta {
                let full = c.emit("dnn.matmul", &[a, d], &[])?;
                let dims: Vec<i64> = (0..batch as i64).collect();
                c.emit("dnn.sum", &[full], &[("dims", AttrValue::Ints(dims))])?
            } else {
                let ds = c.shape(d);
                let rows: i64 = sa[..=batch].iter().product();
                let a2 = c.reshape(a, &[rows, sa[batch + 1]])?;
                let d2 = c.reshape(d, &[rows, ds[batch + 1]])?;
                c.emit(
                    "dnn.matmul",
                    &[a2, d2],
                    &[("transpose_a", AttrValue::Bool(true))],
                )?
            }
        } else {
            c.emit(
                "dnn.matmul",
                &[a, d],
                &[("transpose_a", AttrValue::Bool(!ta))],
            )?
        };
        out[1] = Some(if tb { c.swap_last(g)? } else { g });
    }
    Ok(out)
}

/// `dx = dy · W` (a matmul keeps `x`'s leading dims, so their splits carry over),
/// `dW = linear_weight_grad(dy, x)` (summed over the leading dims without flattening them:
/// a split of the positions alone leaves it partial rather than gathering both operands),
/// `db = sum(dy)` over the leading dims.
fn linear(c: &mut VjpCtx<'_>) -> Result<Vec<Option<ValueId>>, String> {
    let d = c.dy(0)?;
    let (x, w) = (c.x(0), c.x(1));
    let sx = c.shape(x);
    let lead: Vec<i64> = (0..sx.len().saturating_sub(1) as i64).collect();
    let mut out = vec![None; c.node.inputs.len()];
    if c.needs[0] {
        out[0] = Some(if sx.len() >= 2 {
            c.emit("dnn.matmul", &[d, w], &[])?
        } else {
            // A single row: matmul wants rank >= 2.
            let n = c.shape(w)[0];
            let d2 = c.reshape(d, &[1, n])?;
            let g = c.emit("dnn.matmul", &[d2, w], &[])?;
            c.reshape(g, &sx)?
        });
    }
    if c.needs[1] {
        out[1] = Some(c.emit("dnn.linear_weight_grad", &[d, x], &[])?);
    }
    if c.node.inputs.len() == 3 && c.needs[2] {
        out[2] = Some(if lead.is_empty() {
            d
        } else {
            c.emit("dnn.sum", &[d], &[("dims", AttrValue::Ints(lead))])?
        });
    }
    Ok(out)
}

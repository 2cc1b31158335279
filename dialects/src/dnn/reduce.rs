//! Reductions: sum, mean, max and the gradient of max.

use super::*;
use crate::types::ValueId;
use crate::vjp::{VjpCtx, VjpRule};

/// The reduced dims of a reduction, normalized and sorted.
pub(super) fn reduce_dims(ctx: &OpCtx<'_>, rank: usize) -> Result<Vec<usize>, String> {
    let mut dims = Vec::new();
    for &d in ctx.ints("dims")? {
        let d = ctx.norm_dim(d, rank)?;
        if dims.contains(&d) {
            return Err(format!("attribute 'dims' names dimension {d} twice"));
        }
        dims.push(d);
    }
    dims.sort();
    Ok(dims)
}

pub(super) fn reduce_out(ctx: &OpCtx<'_>, rank: usize, dims: &[usize]) -> Vec<String> {
    let keep = ctx.bool_or("keepdim", false);
    (0..rank)
        .filter_map(|i| match (dims.contains(&i), keep) {
            (false, _) => Some(id(i)),
            (true, true) => Some("1".into()),
            (true, false) => None,
        })
        .collect()
}

pub(super) fn sum_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let r = ctx.rank(0)?;
    let dims = reduce_dims(ctx, r)?;
    Ok(format!(
        "{} -> {}",
        join(&ids_with(r, &dims, "+")),
        join(&reduce_out(ctx, r, &dims))
    ))
}

/// Reduced dims are marked `+`: splitting one leaves partial maxima (V(max)), which an
/// all_reduce(max) completes (the layout algebra knows `dnn.max` reduces by max).
pub(super) fn max_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let r = ctx.rank(0)?;
    let dims = reduce_dims(ctx, r)?;
    Ok(format!(
        "{} -> {}",
        join(&ids_with(r, &dims, "+")),
        join(&reduce_out(ctx, r, &dims))
    ))
}

pub(super) fn max_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let r = ctx.rank(1)?;
    let dims = reduce_dims(ctx, r)?;
    let full = join(&ids_with(r, &dims, "^"));
    Ok(format!(
        "{}, {full} -> {full}",
        join(&reduce_out(ctx, r, &dims))
    ))
}

pub(super) fn local_mean(c: &mut LocalCtx<'_>) -> Result<(), String> {
    let x = &c.operands[0];
    let rank = x.rank() as i64;
    let dims: Vec<usize> = match c.attrs.get("dims") {
        Some(AttrValue::Ints(d)) => d
            .iter()
            .map(|&d| (if d < 0 { d + rank } else { d }) as usize)
            .collect(),
        _ => Vec::new(),
    };
    if dims.iter().any(|&d| c.split(0, d)) {
        let count: i64 = dims.iter().map(|&d| x.shape[d]).product();
        set_count(c, count);
    }
    Ok(())
}

pub(super) const SUM: OpSpec = OpSpec {
    name: "dnn.sum",
    summary: "Sum over dimensions",
    operands: &["x"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["y"],
    attrs: &[DIMS, KEEPDIM],
    annotation: sum_anno,
    result_types: None,
    flops: zero_flops,
    grad_of: None,
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        ..TRAITS
    },
    example: r#"%1 = "dnn.sum"(%0) {dims = array<i64: 1>} : (tensor<2x3xf32>) -> tensor<2xf32>"#,
};

pub(super) const MEAN: OpSpec = OpSpec {
    name: "dnn.mean",
    summary: "Mean over dimensions",
    operands: &["x"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["y"],
    attrs: &[DIMS, KEEPDIM, COUNT],
    annotation: sum_anno,
    result_types: None,
    flops: zero_flops,
    grad_of: None,
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        localize: Some(local_mean),
        ..TRAITS
    },
    example: r#"%1 = "dnn.mean"(%0) {dims = array<i64: 0, 1>} : (tensor<2x3xf32>) -> tensor<f32>"#,
};

pub(super) const MAX: OpSpec = OpSpec {
    name: "dnn.max",
    summary: "Maximum over dimensions",
    operands: &["x"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["y"],
    attrs: &[DIMS, KEEPDIM],
    annotation: max_anno,
    result_types: None,
    flops: zero_flops,
    grad_of: None,
    traits: Traits {
        partial_max: true,
        ..TRAITS
    },
    example: r#"%1 = "dnn.max"(%0) {dims = array<i64: 1>, keepdim = true} : (tensor<2x3xf32>) -> tensor<2x1xf32>"#,
};

pub(super) const MAX_GRAD: OpSpec = OpSpec {
    name: "dnn.max_grad",
    summary: "Routes dy to the positions of the maximum of x",
    operands: &["dy", "x"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["dx"],
    attrs: &[DIMS, KEEPDIM],
    annotation: max_grad_anno,
    result_types: None,
    flops: zero_flops,
    grad_of: Some("dnn.max"),
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        ..TRAITS
    },
    example: r#"%2 = "dnn.max_grad"(%0, %1) {dims = array<i64: 1>} : (tensor<2xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>"#,
};

/// The VJP rules of the reductions.
pub(super) fn vjp_rule(op: &str) -> Option<VjpRule> {
    Some(match op {
        "dnn.sum" => |c| {
            let d = c.dy(0)?;
            Ok(vec![Some(unreduce(c, d)?)])
        },
        "dnn.mean" => |c| {
            let d = c.dy(0)?;
            let b = unreduce(c, d)?;
            let (xs, ys) = (c.shape(c.x(0)), c.shape(c.y(0)));
            let n = xs.iter().product::<i64>() / ys.iter().product::<i64>().max(1);
            Ok(vec![Some(c.scale(b, 1.0 / n as f64)?)])
        },
        "dnn.max" => |c| {
            let (d, x) = (c.dy(0)?, c.x(0));
            let a = c.keep(&["dims", "keepdim"]);
            Ok(vec![Some(c.emit("dnn.max_grad", &[d, x], &a)?)])
        },
        _ => return None,
    })
}

/// Broadcasts the gradient of a `keepdim`-less or `keepdim` reduction back to the input.
fn unreduce(c: &mut VjpCtx<'_>, d: ValueId) -> Result<ValueId, String> {
    let xs = c.shape(c.x(0));
    let r = xs.len() as i64;
    let dims: Vec<i64> = match c.node.attrs.get("dims") {
        Some(AttrValue::Ints(v)) => v.iter().map(|&k| if k < 0 { k + r } else { k }).collect(),
        _ => Vec::new(),
    };
    let kept: Vec<i64> = xs
        .iter()
        .enumerate()
        .map(|(i, &n)| if dims.contains(&(i as i64)) { 1 } else { n })
        .collect();
    let d = c.reshape(d, &kept)?;
    if kept == xs {
        return Ok(d);
    }
    c.emit("dnn.broadcast_to", &[d], &[("shape", AttrValue::Ints(xs))])
}

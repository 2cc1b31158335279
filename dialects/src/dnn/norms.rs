//! Normalizations over the last dim: softmax, log-softmax, LayerNorm, RMSNorm and their
//! gradients.

use super::*;
use crate::vjp::VjpRule;

pub(super) fn softmax_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let r = ctx.rank(0)?;
    let d = ctx.norm_dim(ctx.int_or("dim", -1), r)?;
    let v = join(&ids_with(r, &[d], "^"));
    Ok(format!("{v} -> {v}"))
}

pub(super) fn softmax_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let r = ctx.rank(0)?;
    let d = ctx.norm_dim(ctx.int_or("dim", -1), r)?;
    let v = join(&ids_with(r, &[d], "^"));
    Ok(format!("{v}, {v} -> {v}"))
}

pub(super) fn layer_norm_anno(_: &OpCtx<'_>) -> Result<String, String> {
    Ok("* h^, h^, h^ -> * h^".into())
}

pub(super) fn rms_norm_anno(_: &OpCtx<'_>) -> Result<String, String> {
    Ok("* h^, h^ -> * h^".into())
}

pub(super) fn norm_grad_anno(ctx: &OpCtx<'_>, with_bias: bool) -> Result<String, String> {
    let r = ctx.rank(0)?;
    let lead = join(&summed_lead(r, 1));
    let t = if lead.is_empty() {
        "h^".to_string()
    } else {
        format!("{lead} h^")
    };
    let outs = if with_bias {
        format!("{t}, h^, h^")
    } else {
        format!("{t}, h^")
    };
    Ok(format!("{t}, {t}, h^ -> {outs}"))
}

pub(super) fn layer_norm_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    norm_grad_anno(ctx, true)
}

pub(super) fn rms_norm_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    norm_grad_anno(ctx, false)
}

pub(super) const SOFTMAX: OpSpec = OpSpec {
    name: "dnn.softmax",
    summary: "Softmax along one dimension",
    operands: &["x"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["y"],
    attrs: &[DIM],
    annotation: softmax_anno,
    result_types: None,
    flops: flops_x4,
    grad_of: None,
    traits: TRAITS,
    example: r#"%1 = "dnn.softmax"(%0) {dim = -1 : i64} : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
};

pub(super) const LOG_SOFTMAX: OpSpec = OpSpec {
    name: "dnn.log_softmax",
    summary: "Log of softmax along one dimension",
    operands: &["x"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["y"],
    attrs: &[DIM],
    annotation: softmax_anno,
    result_types: None,
    flops: flops_x4,
    grad_of: None,
    traits: TRAITS,
    example: r#"%1 = "dnn.log_softmax"(%0) {dim = 1 : i64} : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
};

pub(super) const LAYER_NORM: OpSpec = OpSpec {
    name: "dnn.layer_norm",
    summary: "Layer normalization over the last dimension, with weight and bias",
    operands: &["x", "weight", "bias"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["y"],
    attrs: &[EPS],
    annotation: layer_norm_anno,
    result_types: None,
    flops: flops_x8,
    grad_of: None,
    traits: Traits {
        param_init: &[
            (1, Init::Const(1.0), "weight"),
            (2, Init::Const(0.0), "bias"),
        ],
        ..TRAITS
    },
    example: r#"%3 = "dnn.layer_norm"(%0, %1, %2) {eps = 1.0e-5 : f64} : (tensor<2x3x8xf32>, tensor<8xf32>, tensor<8xf32>) -> tensor<2x3x8xf32>"#,
};

pub(super) const RMS_NORM: OpSpec = OpSpec {
    name: "dnn.rms_norm",
    summary: "RMS normalization over the last dimension, with weight",
    operands: &["x", "weight"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["y"],
    attrs: &[EPS],
    annotation: rms_norm_anno,
    result_types: None,
    flops: flops_x4,
    grad_of: None,
    traits: Traits {
        param_init: &[(1, Init::Const(1.0), "weight")],
        ..TRAITS
    },
    example: r#"%2 = "dnn.rms_norm"(%0, %1) {eps = 1.0e-5 : f64} : (tensor<2x3x8xf32>, tensor<8xf32>) -> tensor<2x3x8xf32>"#,
};

pub(super) const SOFTMAX_GRAD: OpSpec = OpSpec {
    name: "dnn.softmax_grad",
    summary: "Softmax backward, given the forward output y",
    operands: &["dy", "y"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["dx"],
    attrs: &[DIM],
    annotation: softmax_grad_anno,
    result_types: None,
    flops: flops_x4,
    grad_of: Some("dnn.softmax"),
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        ..TRAITS
    },
    example: r#"%2 = "dnn.softmax_grad"(%0, %1) {dim = -1 : i64} : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>"#,
};

pub(super) const LOG_SOFTMAX_GRAD: OpSpec = OpSpec {
    name: "dnn.log_softmax_grad",
    summary: "Log-softmax backward, given the forward output y",
    operands: &["dy", "y"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["dx"],
    attrs: &[DIM],
    annotation: softmax_grad_anno,
    result_types: None,
    flops: flops_x4,
    grad_of: Some("dnn.log_softmax"),
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        ..TRAITS
    },
    example: r#"%2 = "dnn.log_softmax_grad"(%0, %1) {dim = -1 : i64} : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>"#,
};

pub(super) const LAYER_NORM_GRAD: OpSpec = OpSpec {
    name: "dnn.layer_norm_grad",
    summary: "Layer-norm backward: dx, dweight, dbias",
    operands: &["dy", "x", "weight"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["dx", "dweight", "dbias"],
    attrs: &[EPS],
    annotation: layer_norm_grad_anno,
    result_types: None,
    flops: flops_x10,
    grad_of: Some("dnn.layer_norm"),
    traits: TRAITS,
    example: r#"%3:3 = "dnn.layer_norm_grad"(%0, %1, %2) : (tensor<2x3x8xf32>, tensor<2x3x8xf32>, tensor<8xf32>) -> (tensor<2x3x8xf32>, tensor<8xf32>, tensor<8xf32>)"#,
};

pub(super) const RMS_NORM_GRAD: OpSpec = OpSpec {
    name: "dnn.rms_norm_grad",
    summary: "RMS-norm backward: dx, dweight",
    operands: &["dy", "x", "weight"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["dx", "dweight"],
    attrs: &[EPS],
    annotation: rms_norm_grad_anno,
    result_types: None,
    flops: flops_x8,
    grad_of: Some("dnn.rms_norm"),
    traits: TRAITS,
    example: r#"%3:2 = "dnn.rms_norm_grad"(%0, %1, %2) : (tensor<2x3x8xf32>, tensor<2x3x8xf32>, tensor<8xf32>) -> (tensor<2x3x8xf32>, tensor<8xf32>)"#,
};

/// The VJP rules of the normalizations.
pub(super) fn vjp_rule(op: &str) -> Option<VjpRule> {
    Some(match op {
        "dnn.softmax" => |c| {
            let (d, y) = (c.dy(0)?, c.y(0));
            let a = c.keep(&["dim"]);
            Ok(vec![Some(c.emit("dnn.softmax_grad", &[d, y], &a)?)])
        },
        "dnn.log_softmax" => |c| {
            let (d, y) = (c.dy(0)?, c.y(0));
            let a = c.keep(&["dim"]);
            Ok(vec![Some(c.emit("dnn.log_softmax_grad", &[d, y], &a)?)])
        },
        "dnn.layer_norm" => |c| {
            let (d, x, w) = (c.dy(0)?, c.x(0), c.x(1));
            let a = c.keep(&["eps"]);
            let g = c.emit_n("dnn.layer_norm_grad", &[d, x, w], &a)?;
            Ok(g.into_iter().map(Some).collect())
        },
        "dnn.rms_norm" => |c| {
            let (d, x, w) = (c.dy(0)?, c.x(0), c.x(1));
            let a = c.keep(&["eps"]);
            let g = c.emit_n("dnn.rms_norm_grad", &[d, x, w], &a)?;
            Ok(g.into_iter().map(Some).collect())
        },
        _ => return None,
    })
}

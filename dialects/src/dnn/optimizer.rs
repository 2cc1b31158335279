//! Optimizer ops: AdamW and the clipping scale.

use super::*;

pub(super) fn adamw_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let n = ctx.operands.len();
    for (i, what) in [(4, "lr"), (5, "step"), (6, "scale")] {
        if i < n && ctx.rank(i)? != 0 {
            return Err(format!("operand {i} ({what}) must be a scalar"));
        }
    }
    Ok(if n == 7 {
        "*, *, *, *, , , -> *, *, *"
    } else {
        "*, *, *, *, , -> *, *, *"
    }
    .into())
}

pub(super) fn clip_scale_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    if ctx.rank(0)? != 0 {
        return Err("operand 0 (the summed squares) must be a scalar".into());
    }
    Ok("* -> *".into())
}

pub(super) const ADAMW: OpSpec = OpSpec {
    name: "dnn.adamw",
    summary: "One AdamW step (torch.optim.AdamW) on the gradient times scale (clipping's factor; default 1): decoupled weight decay, moments, bias-corrected update; lr, step (from 1) and scale are scalars",
    operands: &["param", "grad", "m", "v", "lr", "step", "scale"],
    variadic: false,
    optional: 1,
    any_elem: false,
    int_operands: &[],
    results: &["param", "m", "v"],
    attrs: &[
        attr("beta1", AttrKind::Float, true, "first moment decay"),
        attr("beta2", AttrKind::Float, true, "second moment decay"),
        attr("eps", AttrKind::Float, true, "added to the root of the second moment"),
        attr("weight_decay", AttrKind::Float, true, "decoupled weight decay (0: none)"),
    ],
    annotation: adamw_anno,
    result_types: None,
    flops: flops_x10,
    grad_of: None,
    traits: Traits {
        optimizer: true,
        ..TRAITS
    },
    example: r#"%3:3 = "dnn.adamw"(%0, %1, %2, %2, %4, %4) {beta1 = 9.0e-01 : f64, beta2 = 9.99e-01 : f64, eps = 1.0e-08 : f64, weight_decay = 1.0e-01 : f64} : (tensor<2x3xf32>, tensor<2x3xf32>, tensor<2x3xf32>, tensor<2x3xf32>, tensor<f32>, tensor<f32>) -> (tensor<2x3xf32>, tensor<2x3xf32>, tensor<2x3xf32>)"#,
};

pub(super) const CLIP_SCALE: OpSpec = OpSpec {
    name: "dnn.clip_scale",
    summary: "Gradient clipping's factor (torch clip_grad_norm_): min(1, max_norm / (sqrt(sumsq) + 1e-6)) of the gradients' summed squares",
    operands: &["sumsq"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["scale"],
    attrs: &[attr("max_norm", AttrKind::Float, true, "the largest global norm kept")],
    annotation: clip_scale_anno,
    result_types: None,
    flops: flops_x4,
    grad_of: None,
    traits: Traits {
        optimizer: true,
        ..TRAITS
    },
    example: r#"%1 = "dnn.clip_scale"(%0) {max_norm = 1.0 : f64} : (tensor<f32>) -> tensor<f32>"#,
};

//! Attention (grouped-query, causal) and rotary position embedding, with gradients.

use super::*;
use crate::vjp::VjpRule;

/// Attention over `[b, h, s, d]` queries and `[b, g, t, d]` keys/values; `g` divides `h`
/// (grouped-query attention when `g < h`).
pub(super) fn attention_heads(ctx: &OpCtx<'_>, q: usize, k: usize) -> Result<String, String> {
    let (qs, ks) = (ctx.shape(q)?, ctx.shape(k)?);
    if qs.len() != 4 || ks.len() != 4 {
        return Err(format!(
            "query and key must have rank 4 [batch, heads, seq, dim], got ranks {} and {}",
            qs.len(),
            ks.len()
        ));
    }
    Ok(if qs[1] == ks[1] {
        "h".into()
    } else {
        "(g r)".into()
    })
}

pub(super) fn attention_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let h = attention_heads(ctx, 0, 1)?;
    let kv = if h == "h" { "h" } else { "g" };
    Ok(format!(
        "b {h} s d^, b {kv} t^ d^, b {kv} t^ e^ -> b {h} s e^"
    ))
}

pub(super) fn attention_flops(ctx: &OpCtx<'_>, r: &[TensorType]) -> f64 {
    let (Ok(q), Ok(k)) = (ctx.shape(0), ctx.shape(1)) else {
        return 0.0;
    };
    let (b, h, s, d, t) = (q[0], q[1], q[2], q[3], k[2]);
    let e = r[0].shape[3];
    let full = 2.0 * (b * h * s * t) as f64 * (d + e) as f64;
    if ctx.bool_or("causal", false) {
        full / 2.0
    } else {
        full
    }
}

pub(super) fn attention_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let h = attention_heads(ctx, 1, 2)?;
    let kv = if h == "h" { "h" } else { "g" };
    Ok(format!(
        "b {h} s+ e^, b {h} s+ d^, b {kv} t^ d^, b {kv} t^ e^ -> b {h} s+ d^, b {kv} t^ d^, b {kv} t^ e^"
    ))
}

pub(super) fn attention_grad_flops(ctx: &OpCtx<'_>, _: &[TensorType]) -> f64 {
    // Recomputes the scores and does two matmuls per forward one: ~2.5x forward.
    let sub = [
        ctx.operands[1].clone(),
        ctx.operands[2].clone(),
        ctx.operands[3].clone(),
    ];
    let fctx = OpCtx {
        operands: &sub,
        attrs: ctx.attrs,
    };
    let out = ctx.operands[0]
        .clone()
        .unwrap_or(TensorType::new(&[1], Elem::F32));
    2.5 * attention_flops(&fctx, &[out])
}

pub(super) fn rotary_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let s = ctx.shape(0)?;
    if s.len() != 4 || s[3] % 2 != 0 {
        return Err(format!(
            "operand must be [batch, heads, seq, dim] with an even dim, got {s:?}"
        ));
    }
    Ok("b h s d^ -> b h s d^".into())
}

/// On a shard of the positions (context parallelism), operand `i`'s dim 2: the axes
/// splitting it, from which the device computes where its positions start.
pub(super) fn local_positions(c: &mut LocalCtx<'_>, i: usize) {
    if c.split(i, 2) {
        let axes = c.axes(i, 2);
        c.attrs.insert("seq_axes".into(), axes);
    }
}

/// Queries on a shard of the positions see the keys up to their global position.
pub(super) fn local_attention(c: &mut LocalCtx<'_>) -> Result<(), String> {
    local_positions(c, 0);
    Ok(())
}

pub(super) fn local_attention_grad(c: &mut LocalCtx<'_>) -> Result<(), String> {
    local_positions(c, 1);
    Ok(())
}

/// Rotation angles of the global positions.
pub(super) fn local_rotary(c: &mut LocalCtx<'_>) -> Result<(), String> {
    local_positions(c, 0);
    Ok(())
}

pub(super) const ATTENTION: OpSpec = OpSpec {
    name: "dnn.attention",
    summary:
        "Scaled dot-product attention over [b, h, s, d]; grouped-query when k/v have fewer heads",
    operands: &["q", "k", "v"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["out"],
    attrs: &[CAUSAL, SCALE, SEQ_AXES],
    annotation: attention_anno,
    result_types: None,
    flops: attention_flops,
    grad_of: None,
    traits: Traits {
        megatron_through: true,
        matrix: true,
        localize: Some(local_attention),
        ..TRAITS
    },
    example: r#"%3 = "dnn.attention"(%0, %1, %2) {causal = true} : (tensor<2x4x16x8xf32>, tensor<2x2x16x8xf32>, tensor<2x2x16x8xf32>) -> tensor<2x4x16x8xf32>"#,
};

pub(super) const ROTARY: OpSpec = OpSpec {
    name: "dnn.rotary",
    summary: "Rotary position embedding of [b, h, s, d] (rotate-half form)",
    operands: &["x"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["y"],
    attrs: &[THETA, SEQ_AXES],
    annotation: rotary_anno,
    result_types: None,
    flops: flops_x4,
    grad_of: None,
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        megatron_through: true,
        localize: Some(local_rotary),
        ..TRAITS
    },
    example: r#"%1 = "dnn.rotary"(%0) {theta = 5.0e+5 : f64} : (tensor<2x4x16x8xf32>) -> tensor<2x4x16x8xf32>"#,
};

pub(super) const ATTENTION_GRAD: OpSpec = OpSpec {
    name: "dnn.attention_grad",
    summary: "Attention backward (recomputes scores): dq, dk, dv",
    operands: &["dout", "q", "k", "v"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["dq", "dk", "dv"],
    attrs: &[CAUSAL, SCALE, SEQ_AXES],
    annotation: attention_grad_anno,
    result_types: None,
    flops: attention_grad_flops,
    grad_of: Some("dnn.attention"),
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        matrix: true,
        localize: Some(local_attention_grad),
        ..TRAITS
    },
    example: r#"%4:3 = "dnn.attention_grad"(%0, %1, %2, %3) {causal = true} : (tensor<2x4x16x8xf32>, tensor<2x4x16x8xf32>, tensor<2x4x16x8xf32>, tensor<2x4x16x8xf32>) -> (tensor<2x4x16x8xf32>, tensor<2x4x16x8xf32>, tensor<2x4x16x8xf32>)"#,
};

pub(super) const ROTARY_GRAD: OpSpec = OpSpec {
    name: "dnn.rotary_grad",
    summary: "Rotary embedding backward (the inverse rotation)",
    operands: &["dy"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[],
    results: &["dx"],
    attrs: &[THETA, SEQ_AXES],
    annotation: rotary_anno,
    result_types: None,
    flops: flops_x4,
    grad_of: Some("dnn.rotary"),
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        localize: Some(local_rotary),
        ..TRAITS
    },
    example: r#"%1 = "dnn.rotary_grad"(%0) : (tensor<2x4x16x8xf32>) -> tensor<2x4x16x8xf32>"#,
};

/// The VJP rules of the attention and rotary embedding.
pub(super) fn vjp_rule(op: &str) -> Option<VjpRule> {
    Some(match op {
        "dnn.attention" => |c| {
            let (d, q, k, v) = (c.dy(0)?, c.x(0), c.x(1), c.x(2));
            let a = c.keep(&["causal", "scale"]);
            let g = c.emit_n("dnn.attention_grad", &[d, q, k, v], &a)?;
            Ok(g.into_iter().map(Some).collect())
        },
        "dnn.rotary" => |c| {
            let d = c.dy(0)?;
            let a = c.keep(&["theta"]);
            Ok(vec![Some(c.emit("dnn.rotary_grad", &[d], &a)?)])
        },
        _ => return None,
    })
}

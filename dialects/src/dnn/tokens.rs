//! Ops indexed by token ids and class labels: embedding, cross-entropy, pick and their
//! gradients (vocabulary- and class-parallel forms read their shard offsets).

use super::*;
use crate::vjp::{int, VjpRule};

pub(super) fn embedding_anno(_: &OpCtx<'_>) -> Result<String, String> {
    Ok("*, v+ e -> * e".into())
}

pub(super) fn embedding_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let vocab = ctx.int("vocab")?;
    if vocab <= 0 {
        return Err(format!("attribute 'vocab' must be positive, got {vocab}"));
    }
    let lead = join(&summed_lead(ctx.rank(1)?, 0));
    Ok(format!("{lead} e, {lead} -> {vocab} e"))
}

/// The token identifiers of rank-`rank` logits `[tokens.., classes]`: `n` for one token
/// dim (as before), `a b ..` for several (a batch and its positions).
pub(super) fn token_ids(rank: usize) -> Result<String, String> {
    match rank {
        0 | 1 => Err(format!(
            "logits must have rank >= 2 [tokens.., classes], got rank {rank}"
        )),
        2 => Ok("n".into()),
        r if r > 12 => Err(format!("logits of rank {r}: at most 11 token dims")),
        r => Ok(join(&(0..r - 1).map(id).collect::<Vec<_>>())),
    }
}

pub(super) fn cross_entropy_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let t = marked(&token_ids(ctx.rank(0)?)?, "+");
    Ok(format!("{t} v^, {t} -> "))
}

pub(super) fn cross_entropy_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    if ctx.rank(0)? != 0 {
        return Err("operand 0 (the loss gradient) must be a scalar".into());
    }
    let t = token_ids(ctx.rank(1)?)?;
    Ok(format!(", {t} v^, {t} -> {t} v^"))
}

pub(super) fn pick_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let t = token_ids(ctx.rank(0)?)?;
    Ok(format!("{t} v+, {t} -> {t}"))
}

pub(super) fn pick_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let classes = ctx.int("classes")?;
    if classes <= 0 {
        return Err(format!(
            "attribute 'classes' must be positive, got {classes}"
        ));
    }
    let t = token_ids(ctx.rank(0)? + 1)?;
    Ok(format!("{t}, {t} -> {t} {classes}"))
}

pub(super) fn softmax_xent_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    if ctx.rank(0)? != 0 {
        return Err("operand 0 (the loss gradient) must be a scalar".into());
    }
    let t = token_ids(ctx.rank(1)?)?;
    Ok(format!(", {t} v, {t}, {t} 1 -> {t} v"))
}

/// `vocab` is the local number of rows of the gradient table.
pub(super) fn local_embedding_grad(c: &mut LocalCtx<'_>) -> Result<(), String> {
    let v = c.results[0].shape[0];
    c.attrs.insert("vocab".into(), AttrValue::Int(v));
    Ok(())
}

/// Each device holds a block of the table's rows: it looks up the ids in its block.
pub(super) fn local_embedding(c: &mut LocalCtx<'_>) -> Result<(), String> {
    if c.split(1, 0) {
        let axes = c.axes(1, 0);
        c.attrs.insert("row_axes".into(), axes);
    }
    Ok(())
}

/// The class dim of operand `i`, logits `[tokens.., classes]`.
pub(super) fn class_dim(c: &LocalCtx<'_>, i: usize) -> usize {
    c.operands[i].rank().saturating_sub(1)
}

/// On a split of any token dim of logits operand `i`: the mean's denominator, the global
/// token count.
pub(super) fn count_tokens(c: &mut LocalCtx<'_>, i: usize) {
    let v = class_dim(c, i);
    if (0..v).any(|d| c.split(i, d)) {
        let n = c.operands[i].shape[..v].iter().product();
        set_count(c, n);
    }
}

pub(super) fn local_pick(c: &mut LocalCtx<'_>) -> Result<(), String> {
    let v = class_dim(c, 0);
    if c.split(0, v) {
        let axes = c.axes(0, v);
        c.attrs.insert("offset_axes".into(), axes);
    }
    Ok(())
}

pub(super) fn local_softmax_xent_grad(c: &mut LocalCtx<'_>) -> Result<(), String> {
    let v = class_dim(c, 1);
    if c.split(1, v) {
        let axes = c.axes(1, v);
        c.attrs.insert("offset_axes".into(), axes);
    }
    count_tokens(c, 1);
    Ok(())
}

pub(super) fn local_cross_entropy_at(c: &mut LocalCtx<'_>, logits: usize) -> Result<(), String> {
    count_tokens(c, logits);
    if c.split(logits, class_dim(c, logits)) {
        return Err("a vocabulary-parallel cross-entropy is not supported yet".into());
    }
    Ok(())
}

pub(super) fn local_cross_entropy(c: &mut LocalCtx<'_>) -> Result<(), String> {
    local_cross_entropy_at(c, 0)
}

pub(super) fn local_cross_entropy_grad(c: &mut LocalCtx<'_>) -> Result<(), String> {
    local_cross_entropy_at(c, 1)
}

pub(super) const EMBEDDING: OpSpec = OpSpec {
    name: "dnn.embedding",
    summary: "Rows of a table selected by integer ids",
    operands: &["ids", "table"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[0],
    results: &["y"],
    attrs: &[ROW_AXES],
    annotation: embedding_anno,
    result_types: None,
    flops: zero_flops,
    grad_of: None,
    traits: Traits {
        localize: Some(local_embedding),
        ..TRAITS
    },
    example: r#"%2 = "dnn.embedding"(%0, %1) : (tensor<2x3xi64>, tensor<65x8xf32>) -> tensor<2x3x8xf32>"#,
};

pub(super) const CROSS_ENTROPY: OpSpec = OpSpec {
    name: "dnn.cross_entropy",
    summary: "Mean cross-entropy of [tokens.., vocab] logits (one or more token dims) against integer targets of the token shape",
    operands: &["logits", "targets"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[1],
    results: &["loss"],
    attrs: &[COUNT],
    annotation: cross_entropy_anno,
    result_types: None,
    flops: |ctx, _| ctx.operands[0].as_ref().map_or(0.0, |t| 6.0 * numel(t)),
    grad_of: None,
    traits: Traits {
        localize: Some(local_cross_entropy),
        ..TRAITS
    },
    example: r#"%2 = "dnn.cross_entropy"(%0, %1) : (tensor<2x3x65xf32>, tensor<2x3xi64>) -> tensor<f32>"#,
};

pub(super) const PICK: OpSpec = OpSpec {
    name: "dnn.pick",
    summary: "logits[.., targets[..]] for every token of [tokens.., classes] logits (the target logit of cross-entropy); on a class shard, tokens whose target lies elsewhere give 0",
    operands: &["logits", "targets"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[1],
    results: &["y"],
    attrs: &[OFFSET_AXES],
    annotation: pick_anno,
    result_types: None,
    flops: zero_flops,
    grad_of: None,
    traits: Traits {
        localize: Some(local_pick),
        ..TRAITS
    },
    example: r#"%2 = "dnn.pick"(%0, %1) : (tensor<6x5xf32>, tensor<6xi64>) -> tensor<6xf32>"#,
};

pub(super) const EMBEDDING_GRAD: OpSpec = OpSpec {
    name: "dnn.embedding_grad",
    summary: "Scatter-adds dy rows into a [vocab, e] table gradient",
    operands: &["dy", "ids"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[1],
    results: &["dtable"],
    attrs: &[attr("vocab", AttrKind::Int, true, "number of table rows")],
    annotation: embedding_grad_anno,
    result_types: None,
    flops: |ctx, _| ctx.operands[0].as_ref().map_or(0.0, numel),
    grad_of: Some("dnn.embedding"),
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        localize: Some(local_embedding_grad),
        ..TRAITS
    },
    example: r#"%2 = "dnn.embedding_grad"(%0, %1) {vocab = 65 : i64} : (tensor<2x3x8xf32>, tensor<2x3xi64>) -> tensor<65x8xf32>"#,
};

pub(super) const CROSS_ENTROPY_GRAD: OpSpec = OpSpec {
    name: "dnn.cross_entropy_grad",
    summary: "Cross-entropy backward: dloss * (softmax(logits) - onehot(targets)) / tokens",
    operands: &["dloss", "logits", "targets"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[2],
    results: &["dlogits"],
    attrs: &[COUNT],
    annotation: cross_entropy_grad_anno,
    result_types: None,
    flops: flops_x4,
    grad_of: Some("dnn.cross_entropy"),
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        localize: Some(local_cross_entropy_grad),
        ..TRAITS
    },
    example: r#"%3 = "dnn.cross_entropy_grad"(%0, %1, %2) : (tensor<f32>, tensor<6x65xf32>, tensor<6xi64>) -> tensor<6x65xf32>"#,
};

pub(super) const PICK_GRAD: OpSpec = OpSpec {
    name: "dnn.pick_grad",
    summary:
        "Scatters dy[..] into class targets[..] of each token of a [tokens.., classes] zero tensor",
    operands: &["dy", "targets"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[1],
    results: &["dlogits"],
    attrs: &[attr("classes", AttrKind::Int, true, "number of columns")],
    annotation: pick_grad_anno,
    result_types: None,
    flops: zero_flops,
    grad_of: Some("dnn.pick"),
    traits: TRAITS,
    example: r#"%2 = "dnn.pick_grad"(%0, %1) {classes = 5 : i64} : (tensor<6xf32>, tensor<6xi64>) -> tensor<6x5xf32>"#,
};

pub(super) const SOFTMAX_XENT_GRAD: OpSpec = OpSpec {
    name: "dnn.softmax_xent_grad",
    summary: "Cross-entropy backward from a known log-sum-exp: dloss * (exp(logits - lse) - onehot(targets)) / count; runs on a class shard (vocabulary parallelism)",
    operands: &["dloss", "logits", "targets", "lse"],
    variadic: false,
    optional: 0,
    any_elem: false,
    int_operands: &[2],
    results: &["dlogits"],
    attrs: &[COUNT, OFFSET_AXES],
    annotation: softmax_xent_grad_anno,
    result_types: None,
    flops: flops_x4,
    grad_of: Some("dnn.cross_entropy"),
    traits: Traits {
        localize: Some(local_softmax_xent_grad),
        ..TRAITS
    },
    example: r#"%4 = "dnn.softmax_xent_grad"(%0, %1, %2, %3) : (tensor<f32>, tensor<6x5xf32>, tensor<6xi64>, tensor<6x1xf32>) -> tensor<6x5xf32>"#,
};

/// The VJP rules of the ops indexed by tokens and classes.
pub(super) fn vjp_rule(op: &str) -> Option<VjpRule> {
    Some(match op {
        "dnn.embedding" => |c| {
            let (d, ids) = (c.dy(0)?, c.x(0));
            let vocab = c.shape(c.x(1))[0];
            let g = c.emit("dnn.embedding_grad", &[d, ids], &[("vocab", int(vocab))])?;
            Ok(vec![None, Some(g)])
        },
        "dnn.cross_entropy" => |c| {
            let (d, l, t) = (c.dy(0)?, c.x(0), c.x(1));
            Ok(vec![
                Some(c.emit("dnn.cross_entropy_grad", &[d, l, t], &[])?),
                None,
            ])
        },
        "dnn.pick" => |c| {
            let (d, t) = (c.dy(0)?, c.x(1));
            let classes = *c.shape(c.x(0)).last().unwrap_or(&1);
            Ok(vec![
                Some(c.emit("dnn.pick_grad", &[d, t], &[("classes", int(classes))])?),
                None,
            ])
        },
        _ => return None,
    })
}

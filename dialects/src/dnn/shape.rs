//! Shape ops: reshape, transpose, slice, pad, concat, split and broadcast_to; a split
//! carries through every dim whose pieces stay contiguous.

use super::elementwise::broadcast;
use super::*;
use crate::vjp::{int, VjpRule};

/// Groups input and output dims of a reshape into runs of equal product and annotates
/// each run: one-to-one keeps the id, split/merge uses compound dims, anything else is
/// frozen on input and fixed on output.
pub(super) fn reshape_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let a = ctx.shape(0)?;
    let b = ctx.shape_attr("shape")?;
    let (pa, pb): (i64, i64) = (a.iter().product(), b.iter().product());
    if pa != pb {
        return Err(format!(
            "cannot reshape {a:?} ({pa} elements) to {b:?} ({pb} elements)"
        ));
    }
    let (mut ins, mut outs) = (Vec::new(), Vec::new());
    let (mut i, mut j, mut next) = (0, 0, 0);
    while i < a.len() || j < b.len() {
        if i < a.len() && a[i] == 1 {
            ins.push("1".to_string());
            i += 1;
            continue;
        }
        if j < b.len() && b[j] == 1 {
            outs.push("1".to_string());
            j += 1;
            continue;
        }
        let (i0, j0) = (i, j);
        let (mut p, mut q) = (a[i], b[j]);
        i += 1;
        j += 1;
        while p != q {
            if p < q {
                p *= a[i];
                i += 1;
            } else {
                q *= b[j];
                j += 1;
            }
        }
        let (gi, gj) = (&a[i0..i], &b[j0..j]);
        let mut fresh = || {
            next += 1;
            format!("r{}", next - 1)
        };
        if gi.len() == 1 && gj.len() == 1 {
            let x = fresh();
            ins.push(x.clone());
            outs.push(x);
        } else if gi.len() == 1 {
            let x = fresh();
            let rest: Vec<String> = gj[1..].iter().map(i64::to_string).collect();
            ins.push(format!("({x} {})", join(&rest)));
            outs.push(x);
            outs.extend(rest);
        } else if gj.len() == 1 {
            let xs: Vec<String> = gi.iter().map(|_| fresh()).collect();
            outs.push(format!("({})", join(&xs)));
            ins.extend(xs);
        } else if gcd(gi[0], gj[0]) > 1 {
            // Factors regrouped (`(b n) c -> b (n c)`): a block of the outermost input dim
            // is a contiguous run of the group's elements, as a block of the outermost
            // output dim is; they are the same run when the block count divides both
            // lengths, so the two dims share an identifier of their common factor. The
            // inner dims cut the run into strides: frozen.
            let g = gcd(gi[0], gj[0]);
            let x = fresh();
            let outer = |len: i64| {
                if len == g {
                    x.clone()
                } else {
                    format!("({x} {})", len / g)
                }
            };
            ins.push(outer(gi[0]));
            outs.push(outer(gj[0]));
            ins.extend(gi[1..].iter().map(|_| format!("{}^", fresh())));
            outs.extend(gj[1..].iter().map(i64::to_string));
        } else {
            ins.extend(gi.iter().map(|_| format!("{}^", fresh())));
            outs.extend(gj.iter().map(i64::to_string));
        }
    }
    Ok(format!("{} -> {}", operand(&ins), join(&outs)))
}

pub(super) fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

pub(super) fn transpose_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let r = ctx.rank(0)?;
    let perm = ctx.ints("perm")?;
    let mut seen = vec![false; r];
    if perm.len() != r
        || perm
            .iter()
            .any(|&p| p < 0 || p as usize >= r || std::mem::replace(&mut seen[p as usize], true))
    {
        return Err(format!(
            "attribute 'perm' {perm:?} is not a permutation of 0..{r}"
        ));
    }
    let ins: Vec<String> = (0..r).map(id).collect();
    let outs: Vec<String> = perm.iter().map(|&p| id(p as usize)).collect();
    Ok(format!("{} -> {}", join(&ins), join(&outs)))
}

pub(super) fn slice_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let s = ctx.shape(0)?;
    let d = ctx.norm_dim(ctx.int("dim")?, s.len())?;
    let (start, end) = (ctx.int("start")?, ctx.int("end")?);
    if !(0 <= start && start < end && end <= s[d]) {
        return Err(format!(
            "slice [{start}, {end}) is empty or outside dimension {d} of length {}",
            s[d]
        ));
    }
    let ins = ids_with(s.len(), &[d], "^");
    let mut outs: Vec<String> = (0..s.len()).map(id).collect();
    outs[d] = (end - start).to_string();
    Ok(format!("{} -> {}", join(&ins), join(&outs)))
}

pub(super) fn pad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let s = ctx.shape(0)?;
    let d = ctx.norm_dim(ctx.int("dim")?, s.len())?;
    let (before, after) = (ctx.int("before")?, ctx.int("after")?);
    if before < 0 || after < 0 {
        return Err(format!("padding ({before}, {after}) must not be negative"));
    }
    let ins = ids_with(s.len(), &[d], "^");
    let mut outs: Vec<String> = (0..s.len()).map(id).collect();
    outs[d] = (s[d] + before + after).to_string();
    Ok(format!("{} -> {}", join(&ins), join(&outs)))
}

pub(super) fn concat_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let s0 = ctx.shape(0)?;
    let d = ctx.norm_dim(ctx.int("dim")?, s0.len())?;
    let mut total = 0;
    let mut ins = Vec::new();
    for i in 0..ctx.operands.len() {
        let s = ctx.shape(i)?;
        if s.len() != s0.len() {
            return Err(format!(
                "operand {i} has rank {} but operand 0 has rank {}",
                s.len(),
                s0.len()
            ));
        }
        total += s[d];
        let v: Vec<String> = (0..s.len())
            .map(|k| if k == d { format!("c{i}^") } else { id(k) })
            .collect();
        ins.push(join(&v));
    }
    let mut outs: Vec<String> = (0..s0.len()).map(id).collect();
    outs[d] = total.to_string();
    Ok(format!("{} -> {}", ins.join(", "), join(&outs)))
}

pub(super) fn split_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let s = ctx.shape(0)?;
    let d = ctx.norm_dim(ctx.int("dim")?, s.len())?;
    let sizes = ctx.ints("sizes")?;
    if sizes.iter().any(|&x| x <= 0) || sizes.iter().sum::<i64>() != s[d] {
        return Err(format!(
            "attribute 'sizes' {sizes:?} must be positive and sum to dimension {d} ({})",
            s[d]
        ));
    }
    let ins = ids_with(s.len(), &[d], "^");
    let outs: Vec<String> = sizes
        .iter()
        .map(|&n| {
            let mut v: Vec<String> = (0..s.len()).map(id).collect();
            v[d] = n.to_string();
            join(&v)
        })
        .collect();
    Ok(format!("{} -> {}", join(&ins), outs.join(", ")))
}

pub(super) fn split_results(ctx: &OpCtx<'_>) -> Result<Vec<TensorType>, String> {
    let s = ctx.shape(0)?;
    let d = ctx.norm_dim(ctx.int("dim")?, s.len())?;
    Ok(ctx
        .ints("sizes")?
        .iter()
        .map(|&n| {
            let mut shape = s.to_vec();
            shape[d] = n;
            TensorType::new(
                &shape,
                ctx.operands[0].as_ref().map_or(Elem::F32, |t| t.elem),
            )
        })
        .collect())
}

pub(super) fn broadcast_to_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let s = ctx.shape(0)?;
    let target = ctx.shape_attr("shape")?;
    let out = broadcast(s, target)?;
    if out != target {
        return Err(format!("cannot broadcast {s:?} to {target:?}"));
    }
    let off = target.len() - s.len();
    let ins: Vec<String> = s
        .iter()
        .enumerate()
        .map(|(k, &l)| {
            if l == 1 && target[k + off] != 1 {
                "1".into()
            } else {
                id(k + off)
            }
        })
        .collect();
    let outs: Vec<String> = target
        .iter()
        .enumerate()
        .map(|(k, &l)| {
            if k < off || (s[k - off] == 1 && l != 1) {
                // A dim the operand lacks (or has as 1) is new: splitting it splits the
                // result alone, each device repeating the whole operand into its piece.
                format!("{}={l}", id(k))
            } else {
                id(k)
            }
        })
        .collect();
    Ok(format!("{} -> {}", operand(&ins), join(&outs)))
}

pub(super) const RESHAPE: OpSpec = OpSpec {
    name: "dnn.reshape",
    summary: "Same elements, new shape",
    operands: &["x"],
    variadic: false,
    optional: 0,
    any_elem: true,
    int_operands: &[],
    results: &["y"],
    attrs: &[attr("shape", AttrKind::Ints, true, "the new shape")],
    annotation: reshape_anno,
    result_types: None,
    flops: zero_flops,
    grad_of: None,
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        megatron_through: true,
        localize: Some(local_shape_attr),
        ..TRAITS
    },
    example: r#"%1 = "dnn.reshape"(%0) {shape = array<i64: 2, 3, 2, 4>} : (tensor<2x3x8xf32>) -> tensor<2x3x2x4xf32>"#,
};

pub(super) const TRANSPOSE: OpSpec = OpSpec {
    name: "dnn.transpose",
    summary: "Permutes dimensions: result dim i is operand dim perm[i]",
    operands: &["x"],
    variadic: false,
    optional: 0,
    any_elem: true,
    int_operands: &[],
    results: &["y"],
    attrs: &[attr("perm", AttrKind::Ints, true, "the permutation")],
    annotation: transpose_anno,
    result_types: None,
    flops: zero_flops,
    grad_of: None,
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        megatron_through: true,
        ..TRAITS
    },
    example: r#"%1 = "dnn.transpose"(%0) {perm = array<i64: 0, 2, 1>} : (tensor<2x3x8xf32>) -> tensor<2x8x3xf32>"#,
};

pub(super) const SLICE: OpSpec = OpSpec {
    name: "dnn.slice",
    summary: "The range [start, end) of one dimension",
    operands: &["x"],
    variadic: false,
    optional: 0,
    any_elem: true,
    int_operands: &[],
    results: &["y"],
    attrs: &[
        attr("dim", AttrKind::Int, true, "the sliced dimension"),
        attr("start", AttrKind::Int, true, "first index"),
        attr("end", AttrKind::Int, true, "one past the last index"),
    ],
    annotation: slice_anno,
    result_types: None,
    flops: zero_flops,
    grad_of: None,
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        ..TRAITS
    },
    example: r#"%1 = "dnn.slice"(%0) {dim = 1 : i64, start = 1 : i64, end = 3 : i64} : (tensor<2x3xf32>) -> tensor<2x2xf32>"#,
};

pub(super) const CONCAT: OpSpec = OpSpec {
    name: "dnn.concat",
    summary: "Joins tensors along one dimension",
    operands: &["inputs"],
    variadic: true,
    optional: 0,
    any_elem: true,
    int_operands: &[],
    results: &["y"],
    attrs: &[attr("dim", AttrKind::Int, true, "the joined dimension")],
    annotation: concat_anno,
    result_types: None,
    flops: zero_flops,
    grad_of: None,
    traits: Traits {
        linear: Linearity::Joint(&[0, 1, 2, 3, 4, 5, 6, 7]),
        ..TRAITS
    },
    example: r#"%2 = "dnn.concat"(%0, %1) {dim = 1 : i64} : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x6xf32>"#,
};

pub(super) const SPLIT: OpSpec = OpSpec {
    name: "dnn.split",
    summary: "Cuts one dimension into consecutive pieces",
    operands: &["x"],
    variadic: false,
    optional: 0,
    any_elem: true,
    int_operands: &[],
    results: &["pieces"],
    attrs: &[
        attr("dim", AttrKind::Int, true, "the cut dimension"),
        attr("sizes", AttrKind::Ints, true, "length of each piece"),
    ],
    annotation: split_anno,
    result_types: Some(split_results),
    flops: zero_flops,
    grad_of: None,
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        ..TRAITS
    },
    example: r#"%1:2 = "dnn.split"(%0) {dim = 1 : i64, sizes = array<i64: 1, 2>} : (tensor<2x3xf32>) -> (tensor<2x1xf32>, tensor<2x2xf32>)"#,
};

pub(super) const BROADCAST_TO: OpSpec = OpSpec {
    name: "dnn.broadcast_to",
    summary: "Repeats a tensor to a larger shape (numpy broadcasting); the backward of sum/mean",
    operands: &["x"],
    variadic: false,
    optional: 0,
    any_elem: true,
    int_operands: &[],
    results: &["y"],
    attrs: &[attr("shape", AttrKind::Ints, true, "the target shape")],
    annotation: broadcast_to_anno,
    result_types: None,
    flops: zero_flops,
    grad_of: Some("dnn.sum"),
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        localize: Some(local_shape_attr),
        ..TRAITS
    },
    example: r#"%1 = "dnn.broadcast_to"(%0) {shape = array<i64: 4, 2, 3>} : (tensor<2x1xf32>) -> tensor<4x2x3xf32>"#,
};

pub(super) const PAD: OpSpec = OpSpec {
    name: "dnn.pad",
    summary: "Zero-pads one dimension; the backward of slice",
    operands: &["x"],
    variadic: false,
    optional: 0,
    any_elem: true,
    int_operands: &[],
    results: &["y"],
    attrs: &[
        attr("dim", AttrKind::Int, true, "the padded dimension"),
        attr("before", AttrKind::Int, true, "zeros before"),
        attr("after", AttrKind::Int, true, "zeros after"),
    ],
    annotation: pad_anno,
    result_types: None,
    flops: zero_flops,
    grad_of: Some("dnn.slice"),
    traits: Traits {
        linear: Linearity::Joint(&[0]),
        ..TRAITS
    },
    example: r#"%1 = "dnn.pad"(%0) {dim = 1 : i64, before = 1 : i64, after = 0 : i64} : (tensor<2x2xf32>) -> tensor<2x3xf32>"#,
};

/// The VJP rules of the shape ops.
pub(super) fn vjp_rule(op: &str) -> Option<VjpRule> {
    Some(match op {
        "dnn.reshape" => |c| {
            let d = c.dy(0)?;
            let s = c.shape(c.x(0));
            Ok(vec![Some(c.reshape(d, &s)?)])
        },
        "dnn.transpose" => |c| {
            let d = c.dy(0)?;
            let perm = match c.node.attrs.get("perm") {
                Some(AttrValue::Ints(p)) => p.clone(),
                _ => return Err("transpose without 'perm'".into()),
            };
            let mut inv = vec![0i64; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p as usize] = i as i64;
            }
            Ok(vec![Some(c.emit(
                "dnn.transpose",
                &[d],
                &[("perm", AttrValue::Ints(inv))],
            )?)])
        },
        "dnn.slice" => |c| {
            let d = c.dy(0)?;
            let s = c.shape(c.x(0));
            let geti = |k: &str| match c.node.attrs.get(k) {
                Some(AttrValue::Int(n)) => *n,
                _ => 0,
            };
            let (dim, start, end) = (geti("dim"), geti("start"), geti("end"));
            let nd = if dim < 0 { dim + s.len() as i64 } else { dim };
            let after = s[nd as usize] - end;
            Ok(vec![Some(c.emit(
                "dnn.pad",
                &[d],
                &[
                    ("dim", int(dim)),
                    ("before", int(start)),
                    ("after", int(after)),
                ],
            )?)])
        },
        "dnn.pad" => |c| {
            let d = c.dy(0)?;
            let s = c.shape(c.x(0));
            let geti = |k: &str| match c.node.attrs.get(k) {
                Some(AttrValue::Int(n)) => *n,
                _ => 0,
            };
            let (dim, before) = (geti("dim"), geti("before"));
            let nd = if dim < 0 { dim + s.len() as i64 } else { dim };
            let end = before + s[nd as usize];
            Ok(vec![Some(c.emit(
                "dnn.slice",
                &[d],
                &[("dim", int(dim)), ("start", int(before)), ("end", int(end))],
            )?)])
        },
        "dnn.concat" => |c| {
            let d = c.dy(0)?;
            let dim = match c.node.attrs.get("dim") {
                Some(AttrValue::Int(n)) => *n,
                _ => 0,
            };
            let r = c.shape(d).len() as i64;
            let nd = (if dim < 0 { dim + r } else { dim }) as usize;
            let sizes: Vec<i64> = c
                .node
                .inputs
                .iter()
                .map(|&v| c.g.value(v).shape[nd])
                .collect();
            if sizes.len() == 1 {
                return Ok(vec![Some(d)]);
            }
            let g = c.emit_n(
                "dnn.split",
                &[d],
                &[("dim", int(dim)), ("sizes", AttrValue::Ints(sizes))],
            )?;
            Ok(g.into_iter().map(Some).collect())
        },
        "dnn.split" => |c| {
            let mut ds = Vec::new();
            for i in 0..c.node.outputs.len() {
                ds.push(c.dy(i)?);
            }
            let a = c.keep(&["dim"]);
            Ok(vec![Some(c.emit("dnn.concat", &ds, &a)?)])
        },
        "dnn.broadcast_to" => |c| {
            let d = c.dy(0)?;
            let s = c.shape(c.x(0));
            Ok(vec![Some(c.sum_to(d, &s)?)])
        },
        _ => return None,
    })
}

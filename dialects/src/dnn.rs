//! The `dnn` dialect: compute ops on global shapes, forward and backward.
//!
//! Every op is one [`OpSpec`] in [`SPECS`]. Annotations are computed from operand ranks and
//! attributes, written in nnScaler's language (see [`crate::annotation`]).

use crate::nns::Init;
use crate::scalar;
use crate::spec::{AttrKind, AttrSpec, Linearity, LocalCtx, OpCtx, OpSpec, Traits, TRAITS};
use crate::types::AttrValue;
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

fn unary(_: &OpCtx<'_>) -> Result<String, String> {
    Ok("* -> *".into())
}

fn unary_grad(_: &OpCtx<'_>) -> Result<String, String> {
    Ok("*, * -> *".into())
}

/// Numpy broadcasting of two shapes.
fn broadcast(a: &[i64], b: &[i64]) -> Result<Vec<i64>, String> {
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

fn binary(ctx: &OpCtx<'_>) -> Result<String, String> {
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

fn matmul_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
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

fn matmul_flops(ctx: &OpCtx<'_>, r: &[TensorType]) -> f64 {
    let a = ctx.shape(0).unwrap_or(&[]);
    let k = if ctx.bool_or("transpose_a", false) {
        a.get(a.len().wrapping_sub(2))
    } else {
        a.last()
    };
    2.0 * numel(&r[0]) * k.copied().unwrap_or(1) as f64
}

fn linear_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    Ok(if ctx.operands.len() == 3 {
        "* k+, n k+, n -> * n".into()
    } else {
        "* k+, n k+ -> * n".into()
    })
}

/// `dW = sum over the leading dims of dy^T x`: `a+ b+ n, a+ b+ k -> n k`. The leading dims
/// stay named, so a split of any of them (the batch over `dp`, the positions over `sp`)
/// leaves the weight gradient partial, to be reduced like `dp`'s.
fn linear_weight_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
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

fn linear_weight_grad_flops(ctx: &OpCtx<'_>, r: &[TensorType]) -> f64 {
    let rows = ctx
        .shape(0)
        .ok()
        .map(|s| s[..s.len().saturating_sub(1)].iter().product::<i64>())
        .unwrap_or(1);
    2.0 * numel(&r[0]) * rows as f64
}

fn linear_flops(ctx: &OpCtx<'_>, r: &[TensorType]) -> f64 {
    let k = ctx
        .shape(0)
        .ok()
        .and_then(|s| s.last().copied())
        .unwrap_or(1);
    2.0 * numel(&r[0]) * k as f64
}

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

fn softmax_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let r = ctx.rank(0)?;
    let d = ctx.norm_dim(ctx.int_or("dim", -1), r)?;
    let v = join(&ids_with(r, &[d], "^"));
    Ok(format!("{v} -> {v}"))
}

fn softmax_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let r = ctx.rank(0)?;
    let d = ctx.norm_dim(ctx.int_or("dim", -1), r)?;
    let v = join(&ids_with(r, &[d], "^"));
    Ok(format!("{v}, {v} -> {v}"))
}

fn layer_norm_anno(_: &OpCtx<'_>) -> Result<String, String> {
    Ok("* h^, h^, h^ -> * h^".into())
}

fn rms_norm_anno(_: &OpCtx<'_>) -> Result<String, String> {
    Ok("* h^, h^ -> * h^".into())
}

/// Leading (batch) identifiers of a rank-`r` tensor whose last `tail` dims are named apart,
/// each marked `+` (the weight gradients sum over them).
fn summed_lead(rank: usize, tail: usize) -> Vec<String> {
    (0..rank.saturating_sub(tail))
        .map(|i| format!("{}+", id(i)))
        .collect()
}

fn norm_grad_anno(ctx: &OpCtx<'_>, with_bias: bool) -> Result<String, String> {
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

fn layer_norm_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    norm_grad_anno(ctx, true)
}

fn rms_norm_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    norm_grad_anno(ctx, false)
}

fn embedding_anno(_: &OpCtx<'_>) -> Result<String, String> {
    Ok("*, v+ e -> * e".into())
}

fn embedding_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let vocab = ctx.int("vocab")?;
    if vocab <= 0 {
        return Err(format!("attribute 'vocab' must be positive, got {vocab}"));
    }
    let lead = join(&summed_lead(ctx.rank(1)?, 0));
    Ok(format!("{lead} e, {lead} -> {vocab} e"))
}

/// Groups input and output dims of a reshape into runs of equal product and annotates
/// each run: one-to-one keeps the id, split/merge uses compound dims, anything else is
/// frozen on input and fixed on output.
fn reshape_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
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

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
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

fn transpose_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
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

fn slice_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
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

fn pad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
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

fn concat_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
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

fn split_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
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

fn split_results(ctx: &OpCtx<'_>) -> Result<Vec<TensorType>, String> {
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

/// The reduced dims of a reduction, normalized and sorted.
fn reduce_dims(ctx: &OpCtx<'_>, rank: usize) -> Result<Vec<usize>, String> {
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

fn reduce_out(ctx: &OpCtx<'_>, rank: usize, dims: &[usize]) -> Vec<String> {
    let keep = ctx.bool_or("keepdim", false);
    (0..rank)
        .filter_map(|i| match (dims.contains(&i), keep) {
            (false, _) => Some(id(i)),
            (true, true) => Some("1".into()),
            (true, false) => None,
        })
        .collect()
}

fn sum_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
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
fn max_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let r = ctx.rank(0)?;
    let dims = reduce_dims(ctx, r)?;
    Ok(format!(
        "{} -> {}",
        join(&ids_with(r, &dims, "+")),
        join(&reduce_out(ctx, r, &dims))
    ))
}

fn max_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let r = ctx.rank(1)?;
    let dims = reduce_dims(ctx, r)?;
    let full = join(&ids_with(r, &dims, "^"));
    Ok(format!(
        "{}, {full} -> {full}",
        join(&reduce_out(ctx, r, &dims))
    ))
}

fn broadcast_to_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
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

/// Attention over `[b, h, s, d]` queries and `[b, g, t, d]` keys/values; `g` divides `h`
/// (grouped-query attention when `g < h`).
fn attention_heads(ctx: &OpCtx<'_>, q: usize, k: usize) -> Result<String, String> {
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

fn attention_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let h = attention_heads(ctx, 0, 1)?;
    let kv = if h == "h" { "h" } else { "g" };
    Ok(format!(
        "b {h} s d^, b {kv} t^ d^, b {kv} t^ e^ -> b {h} s e^"
    ))
}

fn attention_flops(ctx: &OpCtx<'_>, r: &[TensorType]) -> f64 {
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

fn attention_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let h = attention_heads(ctx, 1, 2)?;
    let kv = if h == "h" { "h" } else { "g" };
    Ok(format!(
        "b {h} s+ e^, b {h} s+ d^, b {kv} t^ d^, b {kv} t^ e^ -> b {h} s+ d^, b {kv} t^ d^, b {kv} t^ e^"
    ))
}

fn attention_grad_flops(ctx: &OpCtx<'_>, _: &[TensorType]) -> f64 {
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

fn rotary_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let s = ctx.shape(0)?;
    if s.len() != 4 || s[3] % 2 != 0 {
        return Err(format!(
            "operand must be [batch, heads, seq, dim] with an even dim, got {s:?}"
        ));
    }
    Ok("b h s d^ -> b h s d^".into())
}

/// The token identifiers of rank-`rank` logits `[tokens.., classes]`: `n` for one token
/// dim (as before), `a b ..` for several (a batch and its positions).
fn token_ids(rank: usize) -> Result<String, String> {
    match rank {
        0 | 1 => Err(format!(
            "logits must have rank >= 2 [tokens.., classes], got rank {rank}"
        )),
        2 => Ok("n".into()),
        r if r > 12 => Err(format!("logits of rank {r}: at most 11 token dims")),
        r => Ok(join(&(0..r - 1).map(id).collect::<Vec<_>>())),
    }
}

/// `ids` with each identifier marked `mark`.
fn marked(ids: &str, mark: &str) -> String {
    ids.split(' ')
        .map(|i| format!("{i}{mark}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn cross_entropy_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let t = marked(&token_ids(ctx.rank(0)?)?, "+");
    Ok(format!("{t} v^, {t} -> "))
}

fn adamw_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
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

fn clip_scale_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    if ctx.rank(0)? != 0 {
        return Err("operand 0 (the summed squares) must be a scalar".into());
    }
    Ok("* -> *".into())
}

fn cross_entropy_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    if ctx.rank(0)? != 0 {
        return Err("operand 0 (the loss gradient) must be a scalar".into());
    }
    let t = token_ids(ctx.rank(1)?)?;
    Ok(format!(", {t} v^, {t} -> {t} v^"))
}

fn pick_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let t = token_ids(ctx.rank(0)?)?;
    Ok(format!("{t} v+, {t} -> {t}"))
}

fn pick_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let classes = ctx.int("classes")?;
    if classes <= 0 {
        return Err(format!(
            "attribute 'classes' must be positive, got {classes}"
        ));
    }
    let t = token_ids(ctx.rank(0)? + 1)?;
    Ok(format!("{t}, {t} -> {t} {classes}"))
}

fn softmax_xent_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    if ctx.rank(0)? != 0 {
        return Err("operand 0 (the loss gradient) must be a scalar".into());
    }
    let t = token_ids(ctx.rank(1)?)?;
    Ok(format!(", {t} v, {t}, {t} 1 -> {t} v"))
}

fn dropout_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
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

fn fill_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    let shape = ctx.shape_attr("shape")?;
    let v: Vec<String> = shape.iter().map(i64::to_string).collect();
    Ok(format!(" -> {}", join(&v)))
}

fn fill_results(ctx: &OpCtx<'_>) -> Result<Vec<TensorType>, String> {
    let dtype = ctx.str_or("dtype", "f32");
    let elem = Elem::parse(dtype).ok_or(format!("unknown dtype '{dtype}'"))?;
    Ok(vec![TensorType::new(ctx.shape_attr("shape")?, elem)])
}

/// `dnn.cast`: the operand's shape, the element type `to` names (f32 or bf16: f16 would
/// need loss scaling, which nnscaler does not do).
fn cast_types(ctx: &OpCtx<'_>) -> Result<Vec<TensorType>, String> {
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

fn gelu_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    match ctx.str_or("approximate", "none") {
        "none" | "tanh" => Ok("* -> *".into()),
        other => Err(format!(
            "attribute 'approximate' must be \"none\" or \"tanh\", got \"{other}\""
        )),
    }
}

fn gelu_grad_anno(ctx: &OpCtx<'_>) -> Result<String, String> {
    gelu_anno(ctx).map(|_| "*, * -> *".into())
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
    ($name:literal, $of:literal, $summary:literal, $rule:path, $ex:literal) => {
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

/// `vocab` is the local number of rows of the gradient table.
fn local_embedding_grad(c: &mut LocalCtx<'_>) -> Result<(), String> {
    let v = c.results[0].shape[0];
    c.attrs.insert("vocab".into(), AttrValue::Int(v));
    Ok(())
}

/// Each device holds a block of the table's rows: it looks up the ids in its block.
fn local_embedding(c: &mut LocalCtx<'_>) -> Result<(), String> {
    if c.split(1, 0) {
        let axes = c.axes(1, 0);
        c.attrs.insert("row_axes".into(), axes);
    }
    Ok(())
}

/// A mean over a split dim divides by the global count.
fn set_count(c: &mut LocalCtx<'_>, count: i64) {
    c.attrs
        .entry("count".into())
        .or_insert(AttrValue::Int(count));
}

/// On a shard of the positions (context parallelism), operand `i`'s dim 2: the axes
/// splitting it, from which the device computes where its positions start.
fn local_positions(c: &mut LocalCtx<'_>, i: usize) {
    if c.split(i, 2) {
        let axes = c.axes(i, 2);
        c.attrs.insert("seq_axes".into(), axes);
    }
}

/// Queries on a shard of the positions see the keys up to their global position.
fn local_attention(c: &mut LocalCtx<'_>) -> Result<(), String> {
    local_positions(c, 0);
    Ok(())
}

fn local_attention_grad(c: &mut LocalCtx<'_>) -> Result<(), String> {
    local_positions(c, 1);
    Ok(())
}

/// Rotation angles of the global positions.
fn local_rotary(c: &mut LocalCtx<'_>) -> Result<(), String> {
    local_positions(c, 0);
    Ok(())
}

/// The class dim of operand `i`, logits `[tokens.., classes]`.
fn class_dim(c: &LocalCtx<'_>, i: usize) -> usize {
    c.operands[i].rank().saturating_sub(1)
}

/// On a split of any token dim of logits operand `i`: the mean's denominator, the global
/// token count.
fn count_tokens(c: &mut LocalCtx<'_>, i: usize) {
    let v = class_dim(c, i);
    if (0..v).any(|d| c.split(i, d)) {
        let n = c.operands[i].shape[..v].iter().product();
        set_count(c, n);
    }
}

fn local_pick(c: &mut LocalCtx<'_>) -> Result<(), String> {
    let v = class_dim(c, 0);
    if c.split(0, v) {
        let axes = c.axes(0, v);
        c.attrs.insert("offset_axes".into(), axes);
    }
    Ok(())
}

fn local_softmax_xent_grad(c: &mut LocalCtx<'_>) -> Result<(), String> {
    let v = class_dim(c, 1);
    if c.split(1, v) {
        let axes = c.axes(1, v);
        c.attrs.insert("offset_axes".into(), axes);
    }
    count_tokens(c, 1);
    Ok(())
}

fn local_cross_entropy_at(c: &mut LocalCtx<'_>, logits: usize) -> Result<(), String> {
    count_tokens(c, logits);
    if c.split(logits, class_dim(c, logits)) {
        return Err("a vocabulary-parallel cross-entropy is not supported yet".into());
    }
    Ok(())
}

fn local_cross_entropy(c: &mut LocalCtx<'_>) -> Result<(), String> {
    local_cross_entropy_at(c, 0)
}

fn local_cross_entropy_grad(c: &mut LocalCtx<'_>) -> Result<(), String> {
    local_cross_entropy_at(c, 1)
}

fn local_mean(c: &mut LocalCtx<'_>) -> Result<(), String> {
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

/// The mask is indexed by the element's place in the whole tensor.
fn local_dropout(c: &mut LocalCtx<'_>) -> Result<(), String> {
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

/// Every `dnn` op, forward ops first.
pub static SPECS: &[OpSpec] = &[
    OpSpec {
        name: "dnn.matmul",
        summary: "Matrix product with optional batch dims and transposed operands",
        operands: &["lhs", "rhs"],
        variadic: false,
        optional: 0,
        any_elem: false,
        int_operands: &[],
        results: &["out"],
        attrs: &[
            attr("transpose_a", AttrKind::Bool, false, "use lhs transposed (last two dims)"),
            attr("transpose_b", AttrKind::Bool, false, "use rhs transposed (last two dims)"),
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
    },
    OpSpec {
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
    },
    binary_op!("dnn.add", "Elementwise sum with broadcasting", r#"%2 = "dnn.add"(%0, %1) : (tensor<2x3xf32>, tensor<3xf32>) -> tensor<2x3xf32>"#,
        Traits {
            linear: Linearity::Joint(&[0, 1]),
            scalar: Some(scalar::add),
            ..TRAITS
        }
    ),
    binary_op!("dnn.sub", "Elementwise difference with broadcasting", r#"%2 = "dnn.sub"(%0, %1) : (tensor<2x3xf32>, tensor<2x1xf32>) -> tensor<2x3xf32>"#,
        Traits {
            linear: Linearity::Joint(&[0, 1]),
            scalar: Some(scalar::sub),
            ..TRAITS
        }
    ),
    binary_op!("dnn.mul", "Elementwise product with broadcasting", r#"%2 = "dnn.mul"(%0, %1) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>"#,
        Traits {
            linear: Linearity::Each(&[0, 1]),
            megatron_through: true,
            scalar: Some(scalar::mul),
            ..TRAITS
        }
    ),
    binary_op!("dnn.div", "Elementwise quotient with broadcasting", r#"%2 = "dnn.div"(%0, %1) : (tensor<2x3xf32>, tensor<f32>) -> tensor<2x3xf32>"#,
        Traits {
            linear: Linearity::Joint(&[0]),
            scalar: Some(scalar::div),
            ..TRAITS
        }
    ),
    elementwise!("dnn.neg", "-x", out_numel, r#"%1 = "dnn.neg"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
        Traits {
            linear: Linearity::Joint(&[0]),
            scalar: Some(scalar::neg),
            ..TRAITS
        }
    ),
    elementwise!("dnn.exp", "e^x", flops_x4, r#"%1 = "dnn.exp"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
        Traits {
            scalar: Some(scalar::exp),
            ..TRAITS
        }
    ),
    elementwise!("dnn.log", "Natural logarithm", flops_x4, r#"%1 = "dnn.log"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
        Traits {
            scalar: Some(scalar::log),
            ..TRAITS
        }
    ),
    elementwise!("dnn.sqrt", "Square root", flops_x4, r#"%1 = "dnn.sqrt"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
        Traits {
            scalar: Some(scalar::sqrt),
            ..TRAITS
        }
    ),
    elementwise!("dnn.rsqrt", "1 / sqrt(x)", flops_x4, r#"%1 = "dnn.rsqrt"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
        Traits {
            scalar: Some(scalar::rsqrt),
            ..TRAITS
        }
    ),
    elementwise!(
        "dnn.sigmoid",
        "1 / (1 + e^-x)",
        flops_x4,
        r#"%1 = "dnn.sigmoid"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
        Traits {
            megatron_through: true,
            scalar: Some(scalar::sigmoid_op),
            ..TRAITS
        }
    ),
    elementwise!("dnn.tanh", "Hyperbolic tangent", flops_x4, r#"%1 = "dnn.tanh"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
        Traits {
            megatron_through: true,
            scalar: Some(scalar::tanh),
            ..TRAITS
        }
    ),
    OpSpec {
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
            scalar: Some(scalar::gelu),
            ..TRAITS
        },
        example: r#"%1 = "dnn.gelu"(%0) {approximate = "tanh"} : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
    },
    OpSpec {
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
            scalar: Some(scalar::cast),
            ..TRAITS
        },
        example: r#"%1 = "dnn.cast"(%0) {to = "bf16"} : (tensor<2x3xf32>) -> tensor<2x3xbf16>"#,
    },
    elementwise!("dnn.silu", "x * sigmoid(x)", flops_x4, r#"%1 = "dnn.silu"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
        Traits {
            megatron_through: true,
            scalar: Some(scalar::silu),
            ..TRAITS
        }
    ),
    elementwise!("dnn.relu", "max(x, 0)", out_numel, r#"%1 = "dnn.relu"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>"#,
        Traits {
            megatron_through: true,
            scalar: Some(scalar::relu),
            ..TRAITS
        }
    ),
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
            param_init: &[(1, Init::Const(1.0), "weight"), (2, Init::Const(0.0), "bias")],
            ..TRAITS
        },
        example: r#"%3 = "dnn.layer_norm"(%0, %1, %2) {eps = 1.0e-5 : f64} : (tensor<2x3x8xf32>, tensor<8xf32>, tensor<8xf32>) -> tensor<2x3x8xf32>"#,
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
        name: "dnn.attention",
        summary: "Scaled dot-product attention over [b, h, s, d]; grouped-query when k/v have fewer heads",
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
            attr("dtype", AttrKind::Str, false, "element type (default \"f32\")"),
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
    },
    // ---- optimizer ops ----
    OpSpec {
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
    },
    OpSpec {
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
    },
    // ---- backward ops ----
    OpSpec {
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
            scalar: Some(scalar::gelu_grad),
            ..TRAITS
        },
        example: r#"%2 = "dnn.gelu_grad"(%0, %1) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>"#,
    },
    act_grad!("dnn.silu_grad", "dnn.silu", "dy * silu'(x)", scalar::silu_grad, r#"%2 = "dnn.silu_grad"(%0, %1) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>"#),
    act_grad!("dnn.relu_grad", "dnn.relu", "dy where x > 0, else 0", scalar::relu_grad, r#"%2 = "dnn.relu_grad"(%0, %1) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>"#),
    OpSpec {
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
            scalar: Some(scalar::tanh_grad),
            ..TRAITS
        },
        example: r#"%2 = "dnn.tanh_grad"(%0, %1) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>"#,
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
        name: "dnn.pick_grad",
        summary: "Scatters dy[..] into class targets[..] of each token of a [tokens.., classes] zero tensor",
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
    OpSpec {
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
    },
];

/// Looks up a `dnn` op by full name.
pub fn spec(name: &str) -> Option<&'static OpSpec> {
    SPECS.iter().find(|s| s.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{AttrValue, Attrs};

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

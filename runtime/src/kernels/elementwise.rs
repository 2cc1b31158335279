//! Elementwise kernels: broadcasting arithmetic, activations and their gradients, dropout,
//! fill and broadcast_to.

use super::Ctx;
use crate::rng;
use crate::tensor::{numel, strides, Data, Tensor};
use nnscaler_dialects::types::AttrValue;

/// Strides of `shape` (right-aligned in an `out_rank` space) with 0 on broadcast dims.
fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let s = strides(shape);
    let off = out.len() - shape.len();
    (0..out.len())
        .map(|i| {
            if i < off || shape[i - off] == 1 {
                0
            } else {
                s[i - off]
            }
        })
        .collect()
}

/// `out` with its strides in two operands, `sa` and `sb` (0 on broadcast dims), with
/// unit dims dropped and each run of dims that both operands walk as one (each stride is
/// the next one's times that dim, or both are 0) merged into one dim: `[3, 12, 24] +
/// [12, 24]` becomes 3 rows of 288 contiguous elements in the first and the same 288 in
/// the second.
fn coalesce(out: &[usize], sa: &[usize], sb: &[usize]) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let (mut o, mut a, mut b) = (Vec::new(), Vec::new(), Vec::new());
    for d in (0..out.len()).rev() {
        if out[d] == 1 {
            continue;
        }
        match (o.last_mut(), a.last(), b.last()) {
            (Some(n), Some(&ia), Some(&ib)) if sa[d] == ia * *n && sb[d] == ib * *n => *n *= out[d],
            _ => {
                o.push(out[d]);
                a.push(sa[d]);
                b.push(sb[d]);
            }
        }
    }
    o.reverse();
    a.reverse();
    b.reverse();
    (o, a, b)
}

/// Calls `f(out_index, a_offset, b_offset, n, a_stride, b_stride)` for each run of `n`
/// elements of `out` along its (coalesced) last dim, in order.
fn for_each_broadcast(
    out: &[usize],
    sa: &[usize],
    sb: &[usize],
    mut f: impl FnMut(usize, usize, usize, usize, usize, usize),
) {
    let (out, sa, sb) = coalesce(out, sa, sb);
    let r = out.len();
    if r == 0 {
        f(0, 0, 0, 1, 0, 0);
        return;
    }
    let inner = out[r - 1];
    let (ia, ib) = (sa[r - 1], sb[r - 1]);
    let rows = numel(&out[..r - 1]);
    let mut idx = vec![0usize; r - 1];
    let (mut oa, mut ob) = (0usize, 0usize);
    for row in 0..rows {
        f(row * inner, oa, ob, inner, ia, ib);
        // advance the odometer over the leading dims
        for d in (0..r - 1).rev() {
            idx[d] += 1;
            oa += sa[d];
            ob += sb[d];
            if idx[d] < out[d] {
                break;
            }
            oa -= sa[d] * out[d];
            ob -= sb[d] * out[d];
            idx[d] = 0;
        }
    }
}

fn binary(
    ctx: &Ctx<'_>,
    x: &[&Tensor],
    f: impl Fn(f32, f32) -> f32 + Copy,
) -> Result<Vec<Tensor>, String> {
    let (a, b) = (x[0].f()?, x[1].f()?);
    let out = ctx.out_shape(0);
    if x[0].shape == out && x[1].shape == out {
        return Ok(vec![Tensor::f32(&out, map2(a, b, f))]);
    }
    let v = broadcast2(a, &x[0].shape, b, &x[1].shape, &out, f);
    Ok(vec![Tensor::f32(&out, v)])
}

/// `f(a, b)` of `a` (shape `sa`) and `b` (shape `sb`) broadcast to `out`.
fn broadcast2(
    a: &[f32],
    sa: &[usize],
    b: &[f32],
    sb: &[usize],
    out: &[usize],
    f: impl Fn(f32, f32) -> f32 + Copy,
) -> Vec<f32> {
    let sa = broadcast_strides(sa, out);
    let sb = broadcast_strides(sb, out);
    let mut v = vec![0.0f32; numel(out)];
    for_each_broadcast(out, &sa, &sb, |o, oa, ob, n, ia, ib| {
        let y = &mut v[o..o + n];
        // Runs of contiguous elements, or of one element against contiguous ones (a
        // bias, a row's scale), go through the vectorized loops.
        match (ia, ib) {
            (1, 1) => map2_into(&a[oa..oa + n], &b[ob..ob + n], y, f),
            (1, 0) => {
                let q = b[ob];
                map1_into(&a[oa..oa + n], y, |p| f(p, q))
            }
            (0, 1) => {
                let p = a[oa];
                map1_into(&b[ob..ob + n], y, |q| f(p, q))
            }
            _ => {
                for (j, y) in y.iter_mut().enumerate() {
                    *y = f(a[oa + j * ia], b[ob + j * ib]);
                }
            }
        }
    });
    v
}

pub(super) fn add(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    binary(c, x, |p, q| p + q)
}
pub(super) fn sub(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    binary(c, x, |p, q| p - q)
}
pub(super) fn mul(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    binary(c, x, |p, q| p * q)
}
pub(super) fn div(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    binary(c, x, |p, q| p / q)
}

fn unary(x: &Tensor, f: impl Fn(f32) -> f32 + Copy) -> Result<Vec<Tensor>, String> {
    Ok(vec![Tensor::f32(&x.shape, map1(x.f()?, f))])
}

/// `dy`-weighted elementwise derivative: `dx = dy * f(x)`.
fn grad(
    dy: &Tensor,
    x: &Tensor,
    f: impl Fn(f32, f32) -> f32 + Copy,
) -> Result<Vec<Tensor>, String> {
    Ok(vec![Tensor::f32(&x.shape, map2(dy.f()?, x.f()?, f))])
}

/// `dnn.cast`: floats are held as f32, so a cast to bf16 rounds (the interpreter rounds
/// every bf16 result too) and a cast to f32 copies.
pub(super) fn cast(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    match c.attrs.get("to") {
        Some(AttrValue::Str(t)) if t == "bf16" => {
            unary(x[0], nnscaler_dialects::scalar::round_bf16)
        }
        Some(AttrValue::Str(t)) if t == "f32" => unary(x[0], |p| p),
        other => Err(format!(
            "attribute 'to' must be \"f32\" or \"bf16\", got {other:?}"
        )),
    }
}

pub(super) fn neg(_: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    unary(x[0], |p| -p)
}
pub(super) fn exp(_: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    unary(x[0], fast_exp)
}
pub(super) fn log(_: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    unary(x[0], f32::ln)
}
pub(super) fn sqrt(_: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    unary(x[0], f32::sqrt)
}
pub(super) fn rsqrt(_: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    unary(x[0], |p| 1.0 / p.sqrt())
}
/// `dnn.sigmoid` (the same branch-free `exp` as silu's).
pub(super) fn logistic(_: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    unary(x[0], sigmoid)
}

pub(super) fn tanh(_: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    unary(x[0], f32::tanh)
}
pub(super) fn relu(_: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    unary(x[0], |p| p.max(0.0))
}

use super::math::{erf_and_gauss, exp as fast_exp, map1, map1_into, map2, map2_into, sigmoid};

pub(super) fn silu(_: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    unary(x[0], |p| p * sigmoid(p))
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;

const GELU_C: f32 = 0.044_715;

pub(super) fn gelu(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    if c.string("approximate", "none") == "tanh" {
        unary(x[0], |p| {
            0.5 * p * (1.0 + (SQRT_2_OVER_PI * (p + GELU_C * p * p * p)).tanh())
        })
    } else {
        unary(x[0], |p| {
            0.5 * p * (1.0 + erf_and_gauss(p * std::f32::consts::FRAC_1_SQRT_2).0)
        })
    }
}

pub(super) fn gelu_grad(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    if c.string("approximate", "none") == "tanh" {
        grad(x[0], x[1], |d, p| {
            let t = (SQRT_2_OVER_PI * (p + GELU_C * p * p * p)).tanh();
            let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * p * p);
            d * (0.5 * (1.0 + t) + 0.5 * p * (1.0 - t * t) * du)
        })
    } else {
        const INV_SQRT_2PI: f32 = 0.398_942_3;
        grad(x[0], x[1], |d, p| {
            // erf(p / sqrt 2) and exp(-p^2 / 2) from one exponential.
            let (e, g) = erf_and_gauss(p * std::f32::consts::FRAC_1_SQRT_2);
            d * (0.5 * (1.0 + e) + p * INV_SQRT_2PI * g)
        })
    }
}

pub(super) fn silu_grad(_: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    grad(x[0], x[1], |d, p| {
        let s = sigmoid(p);
        d * s * (1.0 + p * (1.0 - s))
    })
}

pub(super) fn relu_grad(_: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    grad(x[0], x[1], |d, p| if p > 0.0 { d } else { 0.0 })
}

pub(super) fn tanh_grad(_: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    grad(x[0], x[1], |d, y| d * (1.0 - y * y))
}

pub(super) fn dropout(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let p = c.float("p", 0.0);
    let mut seed = c.int("seed", 0) as u64;
    if let Some(step) = x.get(1) {
        // A new mask each training step: the seed mixed with the step.
        let t = step
            .f()?
            .first()
            .copied()
            .ok_or("the step must be a scalar")?;
        seed = rng::bits(seed, 0x5eed, t as u64);
    }
    let scale = (1.0 / (1.0 - p)) as f32;
    let xs = x[0].f()?;
    let index = global_index(c, &x[0].shape)?;
    let v = xs
        .iter()
        .enumerate()
        .map(|(i, &q)| {
            if rng::dropout_keep(seed, index(i), p) {
                q * scale
            } else {
                0.0
            }
        })
        .collect();
    Ok(vec![Tensor::f32(&x[0].shape, v)])
}

/// Maps a local flat index to the element's flat index in the whole tensor. A localized
/// op on a shard carries `global_shape` and, per dim, the mesh axes splitting it
/// (`dim_axes`, comma-separated names, empty when whole); without them the tensor is
/// whole and the map is the identity.
fn global_index(c: &Ctx<'_>, local: &[usize]) -> Result<Box<dyn Fn(usize) -> u64>, String> {
    use nnscaler_dialects::types::AttrValue;
    let (Some(AttrValue::Ints(global)), Some(AttrValue::Strs(axes))) =
        (c.attrs.get("global_shape"), c.attrs.get("dim_axes"))
    else {
        return Ok(Box::new(|i| i as u64));
    };
    if global.len() != local.len() || axes.len() != local.len() {
        return Err("'global_shape' and 'dim_axes' must have one entry per dim".into());
    }
    let mut offsets = Vec::with_capacity(local.len());
    for (d, names) in axes.iter().enumerate() {
        let mut attrs = nnscaler_dialects::types::Attrs::new();
        let list: Vec<String> = names
            .split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        attrs.insert("a".into(), AttrValue::Strs(list));
        let sub = Ctx {
            attrs: &attrs,
            out: c.out,
            device: c.device,
        };
        offsets.push(sub.block_offset("a", local[d])? as u64);
    }
    let lstrides = crate::tensor::strides(local);
    let gstrides: Vec<u64> =
        crate::tensor::strides(&global.iter().map(|&g| g as usize).collect::<Vec<_>>())
            .into_iter()
            .map(|s| s as u64)
            .collect();
    Ok(Box::new(move |i| {
        let mut rest = i;
        let mut g = 0u64;
        for d in 0..lstrides.len() {
            let k = rest / lstrides[d];
            rest %= lstrides[d];
            g += (offsets[d] + k as u64) * gstrides[d];
        }
        g
    }))
}

pub(super) fn fill(c: &Ctx<'_>, _: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let shape = c.out_shape(0);
    let value = c.float("value", 0.0);
    let float = c.out.first().is_none_or(|t| t.elem.is_float());
    Ok(vec![if float {
        Tensor::f32(&shape, vec![value as f32; numel(&shape)])
    } else {
        if value.fract() != 0.0 {
            return Err(format!("value {value} is not an integer"));
        }
        Tensor::i64(&shape, vec![value as i64; numel(&shape)])
    }])
}

pub(super) fn broadcast_to(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let out = c.out_shape(0);
    let sa = broadcast_strides(&x[0].shape, &out);
    let zero = vec![0; out.len()];
    match &x[0].data {
        Data::F32(a) => {
            let mut v = vec![0.0f32; numel(&out)];
            for_each_broadcast(&out, &sa, &zero, |o, oa, _, n, ia, _| match ia {
                0 => v[o..o + n].fill(a[oa]),
                1 => v[o..o + n].copy_from_slice(&a[oa..oa + n]),
                _ => {
                    for j in 0..n {
                        v[o + j] = a[oa + j * ia];
                    }
                }
            });
            Ok(vec![Tensor::f32(&out, v)])
        }
        Data::I64(a) => {
            let mut v = vec![0i64; numel(&out)];
            for_each_broadcast(&out, &sa, &zero, |o, oa, _, n, ia, _| {
                for j in 0..n {
                    v[o + j] = a[oa + j * ia];
                }
            });
            Ok(vec![Tensor::i64(&out, v)])
        }
    }
}

/// One AdamW step, as `torch.optim.AdamW` computes it in f32 (on `g x scale` when the
/// clipping factor is given): `p *= 1 - lr wd`;
/// `m = b1 m + (1 - b1) g`; `v = b2 v + (1 - b2) g^2`; `p -= (lr / (1 - b1^t)) m /
/// (sqrt(v) / sqrt(1 - b2^t) + eps)`.
pub fn adamw(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let (p, g, m, v) = (x[0].f()?, x[1].f()?, x[2].f()?, x[3].f()?);
    if g.len() != p.len() || m.len() != p.len() || v.len() != p.len() {
        return Err("param, grad, m and v must have one shape".into());
    }
    let lr = x[4].f()?.first().copied().ok_or("lr must be a scalar")?;
    // Clipping's factor, applied to the gradient first (as clip_grad_norm_ does in place).
    let scale = match x.get(6) {
        Some(s) => Some(s.f()?.first().copied().ok_or("scale must be a scalar")?),
        None => None,
    };
    let t = x[5].f()?.first().copied().ok_or("step must be a scalar")?;
    if t < 1.0 {
        return Err(format!("step counts from 1, got {t}"));
    }
    // Scalars in f64, as torch computes them in Python, applied in f32.
    let (b1, b2) = (c.float("beta1", 0.9), c.float("beta2", 0.999));
    let (eps, wd) = (c.float("eps", 1e-8) as f32, c.float("weight_decay", 0.0));
    let (lr, t) = (f64::from(lr), f64::from(t));
    let bc2_sqrt = (1.0 - b2.powf(t)).sqrt() as f32;
    let step = (lr / (1.0 - b1.powf(t))) as f32;
    let decay = (1.0 - lr * wd) as f32;
    let (a1, a2) = ((1.0 - b1) as f32, (1.0 - b2) as f32);
    let (b1, b2) = (b1 as f32, b2 as f32);
    let n = p.len();
    let (mut po, mut mo, mut vo) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for i in 0..n {
        let gi = scale.map_or(g[i], |s| g[i] * s);
        let mi = b1 * m[i] + a1 * gi;
        let vi = b2 * v[i] + a2 * (gi * gi);
        let denom = vi.sqrt() / bc2_sqrt + eps;
        po.push(p[i] * decay - step * (mi / denom));
        mo.push(mi);
        vo.push(vi);
    }
    let shape = &x[0].shape;
    Ok(vec![
        Tensor::f32(shape, po),
        Tensor::f32(shape, mo),
        Tensor::f32(shape, vo),
    ])
}

/// Gradient clipping's factor: `min(1, max_norm / (sqrt(sumsq) + 1e-6))`.
pub fn clip_scale(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let s = x[0].f()?.first().copied().ok_or("sumsq must be a scalar")?;
    let max = c.float("max_norm", 1.0) as f32;
    let k = (max / (s.sqrt() + 1e-6)).min(1.0);
    Ok(vec![Tensor::f32(&[], vec![k])])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Element `i` of `out` read from `shape` by the broadcasting rules, index by index.
    fn naive_offset(i: usize, shape: &[usize], out: &[usize]) -> usize {
        let (so, s) = (strides(out), strides(shape));
        let off = out.len() - shape.len();
        (0..out.len())
            .filter(|&d| d >= off && shape[d - off] != 1)
            .map(|d| (i / so[d] % out[d]) * s[d - off])
            .sum()
    }

    #[test]
    fn broadcasts_equal_the_index_by_index_rule() {
        // Suffixes, per-row scalars, broadcasts on both sides, inner broadcast dims, unit
        // dims, scalars and empty tensors: every path of `binary`.
        let cases: &[(&[usize], &[usize])] = &[
            (&[2, 3, 4], &[3, 4]),
            (&[2, 3, 4], &[2, 3, 1]),
            (&[2, 1, 4], &[2, 3, 4]),
            (&[4, 1], &[4, 5]),
            (&[2, 1, 4], &[3, 1]),
            (&[1, 4], &[3, 1]),
            (&[3, 1, 5, 1], &[1, 2, 5, 6]),
            (&[2, 3, 4], &[]),
            (&[], &[2, 3]),
            (&[1, 1], &[1]),
            (&[2, 3], &[2, 3]),
            (&[2, 1, 3], &[1, 3]),
            (&[0, 3], &[3]),
        ];
        for (sa, sb) in cases {
            let r = sa.len().max(sb.len());
            let pad = |s: &[usize]| [vec![1; r - s.len()], s.to_vec()].concat();
            let (pa, pb) = (pad(sa), pad(sb));
            let out: Vec<usize> = (0..r)
                .map(|d| if pa[d] == 1 { pb[d] } else { pa[d] })
                .collect();
            let a: Vec<f32> = (0..numel(sa)).map(|i| i as f32 * 0.5 + 1.0).collect();
            let b: Vec<f32> = (0..numel(sb)).map(|i| 100.0 - i as f32).collect();
            let f = |p: f32, q: f32| p * 3.0 - q;
            let got = broadcast2(&a, sa, &b, sb, &out, f);
            let want: Vec<f32> = (0..numel(&out))
                .map(|i| f(a[naive_offset(i, sa, &out)], b[naive_offset(i, sb, &out)]))
                .collect();
            assert_eq!(got, want, "{sa:?} and {sb:?} to {out:?}");
        }
    }

    #[test]
    fn coalescing_merges_the_runs_both_operands_walk() {
        let out = [2, 3, 4];
        let (sa, sb) = (
            broadcast_strides(&[2, 3, 4], &out),
            broadcast_strides(&[3, 4], &out),
        );
        assert_eq!(
            coalesce(&out, &sa, &sb),
            (vec![2, 12], vec![12, 1], vec![0, 1])
        );
        let sb = broadcast_strides(&[2, 3, 1], &out);
        assert_eq!(
            coalesce(&out, &sa, &sb),
            (vec![6, 4], vec![4, 1], vec![1, 0])
        );
        let sb = broadcast_strides(&[], &out);
        assert_eq!(coalesce(&out, &sa, &sb), (vec![24], vec![1], vec![0]));
    }
}

//! Elementwise kernels without a scalar formula: dropout (a mask drawn per element), fill,
//! broadcast_to, and the optimizer's AdamW and clipping factor. The ops with a formula
//! (arithmetic, activations and their gradients, casts) run it: [`super::formula`].

use super::formula::{broadcast_strides, for_each_run};
use super::Ctx;
use crate::rng;
use crate::tensor::{numel, Data, Tensor};

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
            op: c.op,
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
    let st = [broadcast_strides(&x[0].shape, &out)];
    match &x[0].data {
        Data::F32(a) => {
            let mut v = vec![0.0f32; numel(&out)];
            for_each_run(&out, &st, |o, off, n, steps| match steps[0] {
                0 => v[o..o + n].fill(a[off[0]]),
                1 => v[o..o + n].copy_from_slice(&a[off[0]..off[0] + n]),
                s => {
                    for j in 0..n {
                        v[o + j] = a[off[0] + j * s];
                    }
                }
            });
            Ok(vec![Tensor::f32(&out, v)])
        }
        Data::I64(a) => {
            let mut v = vec![0i64; numel(&out)];
            for_each_run(&out, &st, |o, off, n, steps| {
                for j in 0..n {
                    v[o + j] = a[off[0] + j * steps[0]];
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

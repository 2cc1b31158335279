//! Neural-network kernels: softmax family, normalizations, embedding, rotary position
//! embedding and cross-entropy, each with its gradient.

use super::math::exp;
use super::{around, Ctx};
use crate::tensor::Tensor;

/// Applies `f` to every line of `x` along `dim`, as a gathered contiguous slice (copied out
/// and back when the dimension is not the last).
fn along(
    shape: &[usize],
    dim: usize,
    inputs: &[&[f32]],
    mut f: impl FnMut(&[&[f32]], &mut [f32]),
) -> Vec<f32> {
    let (outer, n, inner) = around(shape, dim);
    let mut out = vec![0.0f32; outer * n * inner];
    if inner == 1 {
        for o in 0..outer {
            let ins: Vec<&[f32]> = inputs.iter().map(|x| &x[o * n..(o + 1) * n]).collect();
            f(&ins, &mut out[o * n..(o + 1) * n]);
        }
        return out;
    }
    let mut bufs: Vec<Vec<f32>> = vec![vec![0.0; n]; inputs.len()];
    let mut line = vec![0.0f32; n];
    for o in 0..outer {
        for i in 0..inner {
            let base = o * n * inner + i;
            for (b, x) in bufs.iter_mut().zip(inputs) {
                for (j, v) in b.iter_mut().enumerate() {
                    *v = x[base + j * inner];
                }
            }
            let ins: Vec<&[f32]> = bufs.iter().map(Vec::as_slice).collect();
            f(&ins, &mut line);
            for (j, v) in line.iter().enumerate() {
                out[base + j * inner] = *v;
            }
        }
    }
    out
}

fn softmax_line(x: &[f32], y: &mut [f32]) {
    let mx = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for (o, &v) in y.iter_mut().zip(x) {
        *o = exp(v - mx);
        sum += *o;
    }
    let inv = 1.0 / sum;
    y.iter_mut().for_each(|o| *o *= inv);
}

fn log_softmax_line(x: &[f32], y: &mut [f32]) {
    let mx = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = mx + x.iter().map(|&v| exp(v - mx)).sum::<f32>().ln();
    for (o, &v) in y.iter_mut().zip(x) {
        *o = v - lse;
    }
}

pub(super) fn softmax(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let dim = c.dim("dim", -1, x[0].shape.len());
    let v = along(&x[0].shape, dim, &[x[0].f()?], |i, o| softmax_line(i[0], o));
    Ok(vec![Tensor::f32(&x[0].shape, v)])
}

pub(super) fn log_softmax(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let dim = c.dim("dim", -1, x[0].shape.len());
    let v = along(&x[0].shape, dim, &[x[0].f()?], |i, o| {
        log_softmax_line(i[0], o)
    });
    Ok(vec![Tensor::f32(&x[0].shape, v)])
}

pub(super) fn softmax_grad(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let dim = c.dim("dim", -1, x[0].shape.len());
    let v = along(&x[0].shape, dim, &[x[0].f()?, x[1].f()?], |i, o| {
        let (dy, y) = (i[0], i[1]);
        let dot: f32 = dy.iter().zip(y).map(|(a, b)| a * b).sum();
        for ((o, &d), &p) in o.iter_mut().zip(dy).zip(y) {
            *o = p * (d - dot);
        }
    });
    Ok(vec![Tensor::f32(&x[0].shape, v)])
}

pub(super) fn log_softmax_grad(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let dim = c.dim("dim", -1, x[0].shape.len());
    let v = along(&x[0].shape, dim, &[x[0].f()?, x[1].f()?], |i, o| {
        let (dy, y) = (i[0], i[1]);
        let sum: f32 = dy.iter().sum();
        for ((o, &d), &ly) in o.iter_mut().zip(dy).zip(y) {
            *o = d - exp(ly) * sum;
        }
    });
    Ok(vec![Tensor::f32(&x[0].shape, v)])
}

/// Mean and 1/sqrt(var + eps) of one row (two passes, f64 accumulation).
fn moments(row: &[f32], eps: f64) -> (f32, f32) {
    let n = row.len() as f64;
    let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = row
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    (mean as f32, (1.0 / (var + eps).sqrt()) as f32)
}

fn rms(row: &[f32], eps: f64) -> f32 {
    let ms = row
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        / row.len() as f64;
    (1.0 / (ms + eps).sqrt()) as f32
}

pub(super) fn layer_norm(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let eps = c.float("eps", 1e-5);
    let (xs, w, b) = (x[0].f()?, x[1].f()?, x[2].f()?);
    let h = w.len();
    let mut out = vec![0.0f32; xs.len()];
    for (row, o) in xs.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        let (mean, rstd) = moments(row, eps);
        for j in 0..h {
            o[j] = (row[j] - mean) * rstd * w[j] + b[j];
        }
    }
    Ok(vec![Tensor::f32(&x[0].shape, out)])
}

pub(super) fn layer_norm_grad(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let eps = c.float("eps", 1e-5);
    let (dy, xs, w) = (x[0].f()?, x[1].f()?, x[2].f()?);
    let h = w.len();
    let mut dx = vec![0.0f32; xs.len()];
    let mut dw = vec![0.0f64; h];
    let mut db = vec![0.0f64; h];
    let mut xhat = vec![0.0f32; h];
    let mut g = vec![0.0f32; h];
    for ((row, d), o) in xs
        .chunks_exact(h)
        .zip(dy.chunks_exact(h))
        .zip(dx.chunks_exact_mut(h))
    {
        let (mean, rstd) = moments(row, eps);
        let (mut mg, mut mgx) = (0.0f64, 0.0f64);
        for j in 0..h {
            xhat[j] = (row[j] - mean) * rstd;
            g[j] = d[j] * w[j];
            mg += f64::from(g[j]);
            mgx += f64::from(g[j] * xhat[j]);
            dw[j] += f64::from(d[j] * xhat[j]);
            db[j] += f64::from(d[j]);
        }
        let (mg, mgx) = ((mg / h as f64) as f32, (mgx / h as f64) as f32);
        for j in 0..h {
            o[j] = rstd * (g[j] - mg - xhat[j] * mgx);
        }
    }
    let f = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
    Ok(vec![
        Tensor::f32(&x[1].shape, dx),
        Tensor::f32(&[h], f(dw)),
        Tensor::f32(&[h], f(db)),
    ])
}

pub(super) fn rms_norm(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let eps = c.float("eps", 1e-5);
    let (xs, w) = (x[0].f()?, x[1].f()?);
    let h = w.len();
    let mut out = vec![0.0f32; xs.len()];
    for (row, o) in xs.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        let r = rms(row, eps);
        for j in 0..h {
            o[j] = row[j] * r * w[j];
        }
    }
    Ok(vec![Tensor::f32(&x[0].shape, out)])
}

pub(super) fn rms_norm_grad(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let eps = c.float("eps", 1e-5);
    let (dy, xs, w) = (x[0].f()?, x[1].f()?, x[2].f()?);
    let h = w.len();
    let mut dx = vec![0.0f32; xs.len()];
    let mut dw = vec![0.0f64; h];
    for ((row, d), o) in xs
        .chunks_exact(h)
        .zip(dy.chunks_exact(h))
        .zip(dx.chunks_exact_mut(h))
    {
        let r = rms(row, eps);
        let mut dot = 0.0f64;
        for j in 0..h {
            dot += f64::from(d[j] * w[j] * row[j]);
            dw[j] += f64::from(d[j] * row[j] * r);
        }
        let k = (dot / h as f64) as f32 * r * r;
        for j in 0..h {
            o[j] = r * (d[j] * w[j] - row[j] * k);
        }
    }
    Ok(vec![
        Tensor::f32(&x[1].shape, dx),
        Tensor::f32(&[h], dw.into_iter().map(|v| v as f32).collect()),
    ])
}

fn check_index(id: i64, n: usize, what: &str, pos: usize) -> Result<usize, String> {
    if id < 0 || id as usize >= n {
        return Err(format!("{what} {id} at position {pos} is outside [0, {n})"));
    }
    Ok(id as usize)
}

pub(super) fn embedding(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let (ids, table) = (x[0].ints()?, x[1].f()?);
    let (v, e) = (x[1].shape[0], x[1].shape[1]);
    let mut out = vec![0.0f32; ids.len() * e];
    if c.attrs.contains_key("row_axes") {
        // A shard of the table's rows (vocabulary parallelism): ids of other shards give
        // zero rows, and the sum over shards is the lookup.
        let (off, whole) = c.block("row_axes", v)?;
        for (p, (&id, o)) in ids.iter().zip(out.chunks_exact_mut(e)).enumerate() {
            check_index(id, whole, "token id", p)?;
            let r = id - off as i64;
            if (0..v as i64).contains(&r) {
                let r = r as usize;
                o.copy_from_slice(&table[r * e..(r + 1) * e]);
            }
        }
        return Ok(vec![Tensor::f32(&c.out_shape(0), out)]);
    }
    for (p, (&id, o)) in ids.iter().zip(out.chunks_exact_mut(e)).enumerate() {
        let r = check_index(id, v, "token id", p)?;
        o.copy_from_slice(&table[r * e..(r + 1) * e]);
    }
    Ok(vec![Tensor::f32(&c.out_shape(0), out)])
}

pub(super) fn pick(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let (l, t) = (x[0].f()?, x[1].ints()?);
    let v = classes(x[0]);
    let (off, whole) = c.block("offset_axes", v)?;
    let mut out = vec![0.0f32; t.len()];
    for (i, (o, &target)) in out.iter_mut().zip(t).enumerate() {
        // On a shard of the classes, targets of other shards give 0 (partial sums).
        let k = check_index(target, whole, "target", i)?.wrapping_sub(off);
        if k < v {
            *o = l[i * v + k];
        }
    }
    Ok(vec![Tensor::f32(&x[1].shape, out)])
}

pub(super) fn pick_grad(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let (dy, t) = (x[0].f()?, x[1].ints()?);
    let shape = c.out_shape(0);
    let v = *shape.last().unwrap_or(&1);
    let mut out = vec![0.0f32; t.len() * v];
    for (i, (&d, &target)) in dy.iter().zip(t).enumerate() {
        out[i * v + check_index(target, v, "target", i)?] = d;
    }
    Ok(vec![Tensor::f32(&shape, out)])
}

pub(super) fn softmax_xent_grad(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let (dl, l, t, lse) = (x[0].f()?[0], x[1].f()?, x[2].ints()?, x[3].f()?);
    let v = classes(x[1]);
    let n = count(c, t.len());
    let (off, whole) = c.block("offset_axes", v)?;
    let scale = dl / n as f32;
    let mut out = vec![0.0f32; l.len()];
    for (i, ((row, o), &target)) in l
        .chunks_exact(v)
        .zip(out.chunks_exact_mut(v))
        .zip(t)
        .enumerate()
    {
        for (z, &li) in o.iter_mut().zip(row) {
            *z = exp(li - lse[i]) * scale;
        }
        let k = check_index(target, whole, "target", i)?.wrapping_sub(off);
        if k < v {
            o[k] -= scale;
        }
    }
    Ok(vec![Tensor::f32(&x[1].shape, out)])
}

pub(super) fn embedding_grad(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let (dy, ids) = (x[0].f()?, x[1].ints()?);
    let out = c.out_shape(0);
    let (v, e) = (out[0], out[1]);
    let mut dt = vec![0.0f32; v * e];
    for (p, (&id, d)) in ids.iter().zip(dy.chunks_exact(e)).enumerate() {
        let r = check_index(id, v, "token id", p)?;
        for (o, &g) in dt[r * e..(r + 1) * e].iter_mut().zip(d) {
            *o += g;
        }
    }
    Ok(vec![Tensor::f32(&out, dt)])
}

/// The rotary tables of positions `p0 .. p0 + s` for width `d`: `(cos, sign * sin)`,
/// `[s, d / 2]` each (f64 inverse frequencies, f32 angles, f32 cos and sin). The GPU
/// kernels' constants are these tables.
pub fn rotary_table(p0: usize, s: usize, d: usize, theta: f64, sign: f32) -> (Vec<f32>, Vec<f32>) {
    let half = d / 2;
    let (mut cos, mut sin) = (vec![0.0f32; s * half], vec![0.0f32; s * half]);
    for p in 0..s {
        for j in 0..half {
            let inv = theta.powf(-2.0 * j as f64 / d as f64) as f32;
            let a = (p0 + p) as f32 * inv;
            cos[p * half + j] = a.cos();
            sin[p * half + j] = sign * a.sin();
        }
    }
    (cos, sin)
}

/// Rotates pairs (j, j + d/2) of every [s, d] slice by angle `pos * theta^(-2j/d)` times
/// `sign` (rotate-half form, as in Llama's reference implementation in HF transformers);
/// `pos` is the global position (a shard's start plus the local one).
fn rotate(c: &Ctx<'_>, x: &Tensor, sign: f32) -> Result<Vec<Tensor>, String> {
    let xs = x.f()?;
    let (s, d) = (x.shape[2], x.shape[3]);
    let half = d / 2;
    let theta = c.float("theta", 10000.0);
    // On a shard of the positions (`seq_axes`), they count from its block's start.
    let p0 = c.block_offset("seq_axes", s)?;
    let (cos, sin) = rotary_table(p0, s, d, theta, sign);
    let mut out = vec![0.0f32; xs.len()];
    for (blk, o) in xs.chunks_exact(s * d).zip(out.chunks_exact_mut(s * d)) {
        for p in 0..s {
            let (row, orow) = (&blk[p * d..(p + 1) * d], &mut o[p * d..(p + 1) * d]);
            for j in 0..half {
                let (cc, ss) = (cos[p * half + j], sin[p * half + j]);
                let (a, b) = (row[j], row[j + half]);
                orow[j] = a * cc - b * ss;
                orow[j + half] = b * cc + a * ss;
            }
        }
    }
    Ok(vec![Tensor::f32(&x.shape, out)])
}

pub(super) fn rotary(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    rotate(c, x[0], 1.0)
}

pub(super) fn rotary_grad(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    rotate(c, x[0], -1.0)
}

/// The class count of logits `[tokens.., classes]` (every leading dim is a token).
fn classes(logits: &Tensor) -> usize {
    *logits.shape.last().unwrap_or(&1)
}

/// The mean's denominator: the `count` attribute (the global token count of a split op)
/// or the local count.
fn count(c: &Ctx<'_>, local: usize) -> usize {
    match c.int("count", 0) {
        0 => local,
        k => k as usize,
    }
}

pub(super) fn cross_entropy(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let (l, t) = (x[0].f()?, x[1].ints()?);
    let v = classes(x[0]);
    let n = count(c, t.len());
    let mut total = 0.0f64;
    for (i, (row, &target)) in l.chunks_exact(v).zip(t).enumerate() {
        let k = check_index(target, v, "target", i)?;
        let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = f64::from(mx)
            + row
                .iter()
                .map(|&z| f64::from((z - mx).exp()))
                .sum::<f64>()
                .ln();
        total += lse - f64::from(row[k]);
    }
    Ok(vec![Tensor::scalar((total / n as f64) as f32)])
}

pub(super) fn cross_entropy_grad(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let (dl, l, t) = (x[0].f()?[0], x[1].f()?, x[2].ints()?);
    let v = classes(x[1]);
    let n = count(c, t.len());
    let scale = dl / n as f32;
    let mut out = vec![0.0f32; l.len()];
    for (i, ((row, o), &target)) in l
        .chunks_exact(v)
        .zip(out.chunks_exact_mut(v))
        .zip(t)
        .enumerate()
    {
        let k = check_index(target, v, "target", i)?;
        softmax_line(row, o);
        o[k] -= 1.0;
        o.iter_mut().for_each(|z| *z *= scale);
    }
    Ok(vec![Tensor::f32(&x[1].shape, out)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use nnscaler_dialects::types::{Attrs, Elem, TensorType};

    #[test]
    fn softmax_xent_grad_equals_cross_entropy_grad() {
        let (n, v) = (5usize, 7usize);
        let l = Tensor::f32(
            &[n, v],
            (0..n * v)
                .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3)
                .collect(),
        );
        let t = Tensor::i64(&[n], vec![0, 6, 3, 3, 1]);
        let dl = Tensor::scalar(1.7);
        let lse: Vec<f32> = l
            .f()
            .unwrap()
            .chunks_exact(v)
            .map(|r| {
                let m = r.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                m + r.iter().map(|&z| (z - m).exp()).sum::<f32>().ln()
            })
            .collect();
        let lse = Tensor::f32(&[n, 1], lse);
        let attrs = Attrs::new();
        let out = [TensorType::new(&[n as i64, v as i64], Elem::F32)];
        let c = Ctx {
            op: "dnn.softmax_xent_grad",
            attrs: &attrs,
            out: &out,
            device: None,
        };
        let a = softmax_xent_grad(&c, &[&dl, &l, &t, &lse]).unwrap();
        let b = cross_entropy_grad(&c, &[&dl, &l, &t]).unwrap();
        assert!(a[0].rel_err(&b[0]).unwrap() < 1e-6);
        let p = pick(&c, &[&l, &t]).unwrap();
        assert_eq!(p[0].f().unwrap()[1], l.f().unwrap()[v + 6]);
    }
}

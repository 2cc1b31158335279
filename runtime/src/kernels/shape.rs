//! Data movement (reshape, transpose, slice, pad, concat, split) and reductions.

use super::{around, Ctx};
use crate::tensor::{numel, strides, Tensor};

/// Applies a generic data-movement function to float or integer elements alike.
fn on_data(
    x: &[&Tensor],
    f32s: impl FnOnce(Vec<&[f32]>) -> Vec<Vec<f32>>,
    i64s: impl FnOnce(Vec<&[i64]>) -> Vec<Vec<i64>>,
    shapes: &[Vec<usize>],
) -> Vec<Tensor> {
    if x.iter().all(|t| t.is_float()) {
        let ins = x.iter().map(|t| t.f().unwrap_or(&[])).collect();
        f32s(ins)
            .into_iter()
            .zip(shapes)
            .map(|(v, s)| Tensor::f32(s, v))
            .collect()
    } else {
        let ins = x.iter().map(|t| t.ints().unwrap_or(&[])).collect();
        i64s(ins)
            .into_iter()
            .zip(shapes)
            .map(|(v, s)| Tensor::i64(s, v))
            .collect()
    }
}

fn same_kind(x: &[&Tensor]) -> Result<(), String> {
    if x.iter().all(|t| t.is_float()) || x.iter().all(|t| !t.is_float()) {
        Ok(())
    } else {
        Err("operands mix float and integer tensors".into())
    }
}

pub(super) fn reshape(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    Ok(vec![x[0].clone().reshaped(&c.out_shape(0))])
}

fn permute<T: Copy + Default>(x: &[T], shape: &[usize], perm: &[usize]) -> Vec<T> {
    let r = shape.len();
    let out: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
    let st = strides(shape);
    let src: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
    let mut v = vec![T::default(); x.len()];
    if r == 0 || x.is_empty() {
        v.copy_from_slice(x);
        return v;
    }
    let inner = out[r - 1];
    let is = src[r - 1];
    let mut idx = vec![0usize; r - 1];
    let mut off = 0usize;
    for row in 0..numel(&out[..r - 1]) {
        let dst = &mut v[row * inner..(row + 1) * inner];
        if is == 1 {
            dst.copy_from_slice(&x[off..off + inner]);
        } else {
            for (j, d) in dst.iter_mut().enumerate() {
                *d = x[off + j * is];
            }
        }
        for k in (0..r - 1).rev() {
            idx[k] += 1;
            off += src[k];
            if idx[k] < out[k] {
                break;
            }
            off -= src[k] * out[k];
            idx[k] = 0;
        }
    }
    v
}

pub(super) fn transpose(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let perm: Vec<usize> = c.ints("perm").into_iter().map(|p| p as usize).collect();
    let s = x[0].shape.clone();
    Ok(on_data(
        x,
        |i| vec![permute(i[0], &s, &perm)],
        |i| vec![permute(i[0], &s, &perm)],
        &[c.out_shape(0)],
    ))
}

/// Copies `[outer, n, inner]` blocks: the range `[from, from + len)` of dimension `n` of `x`
/// into position `to` of an `[outer, m, inner]` output.
fn copy_range<T: Copy>(
    x: &[T],
    y: &mut [T],
    (outer, n, inner): (usize, usize, usize),
    m: usize,
    from: usize,
    to: usize,
    len: usize,
) {
    for o in 0..outer {
        let src = &x[(o * n + from) * inner..(o * n + from + len) * inner];
        y[(o * m + to) * inner..(o * m + to + len) * inner].copy_from_slice(src);
    }
}

pub(super) fn slice(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let s = &x[0].shape;
    let d = c.dim("dim", 0, s.len());
    let (start, end) = (c.int("start", 0) as usize, c.int("end", 0) as usize);
    let g = around(s, d);
    let len = end - start;
    let out = c.out_shape(0);
    Ok(on_data(
        x,
        |i| {
            let mut y = vec![0.0; numel(&out)];
            copy_range(i[0], &mut y, g, len, start, 0, len);
            vec![y]
        },
        |i| {
            let mut y = vec![0; numel(&out)];
            copy_range(i[0], &mut y, g, len, start, 0, len);
            vec![y]
        },
        std::slice::from_ref(&out),
    ))
}

pub(super) fn pad(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let s = &x[0].shape;
    let d = c.dim("dim", 0, s.len());
    let before = c.int("before", 0) as usize;
    let g = around(s, d);
    let out = c.out_shape(0);
    let m = out[d];
    Ok(on_data(
        x,
        |i| {
            let mut y = vec![0.0; numel(&out)];
            copy_range(i[0], &mut y, g, m, 0, before, g.1);
            vec![y]
        },
        |i| {
            let mut y = vec![0; numel(&out)];
            copy_range(i[0], &mut y, g, m, 0, before, g.1);
            vec![y]
        },
        std::slice::from_ref(&out),
    ))
}

pub(super) fn concat(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    same_kind(x)?;
    let out = c.out_shape(0);
    let d = c.dim("dim", 0, out.len());
    let gs: Vec<(usize, usize, usize)> = x.iter().map(|t| around(&t.shape, d)).collect();
    Ok(on_data(
        x,
        |i| vec![concat_into(&i, &gs, out[d], numel(&out))],
        |i| vec![concat_into(&i, &gs, out[d], numel(&out))],
        std::slice::from_ref(&out),
    ))
}

fn concat_into<T: Copy + Default>(
    ins: &[&[T]],
    gs: &[(usize, usize, usize)],
    m: usize,
    total: usize,
) -> Vec<T> {
    let mut y = vec![T::default(); total];
    let mut at = 0;
    for (xi, &g) in ins.iter().zip(gs) {
        copy_range(xi, &mut y, g, m, 0, at, g.1);
        at += g.1;
    }
    y
}

pub(super) fn split(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let s = &x[0].shape;
    let d = c.dim("dim", 0, s.len());
    let g = around(s, d);
    let shapes: Vec<Vec<usize>> = (0..c.out.len()).map(|i| c.out_shape(i)).collect();
    let pieces = |n: usize| -> Vec<(usize, usize)> {
        let mut at = 0;
        shapes
            .iter()
            .take(n)
            .map(|sh| {
                let r = (at, sh[d]);
                at += sh[d];
                r
            })
            .collect()
    };
    let ps = pieces(shapes.len());
    Ok(on_data(
        x,
        |i| {
            ps.iter()
                .map(|&(at, len)| {
                    let mut y = vec![0.0; g.0 * len * g.2];
                    copy_range(i[0], &mut y, g, len, at, 0, len);
                    y
                })
                .collect()
        },
        |i| {
            ps.iter()
                .map(|&(at, len)| {
                    let mut y = vec![0; g.0 * len * g.2];
                    copy_range(i[0], &mut y, g, len, at, 0, len);
                    y
                })
                .collect()
        },
        &shapes,
    ))
}

/// Strides that map an input index to its output offset, 0 on the reduced `dims`.
fn reduced_strides(shape: &[usize], dims: &[usize]) -> Vec<usize> {
    let kept: Vec<usize> = (0..shape.len())
        .map(|i| if dims.contains(&i) { 1 } else { shape[i] })
        .collect();
    let s = strides(&kept);
    (0..shape.len())
        .map(|i| if dims.contains(&i) { 0 } else { s[i] })
        .collect()
}

/// Folds every element of `x` into `acc[out_offset]`.
fn reduce<A: Copy>(
    x: &[f32],
    shape: &[usize],
    dims: &[usize],
    init: A,
    f: impl Fn(A, f32) -> A,
) -> Vec<A> {
    let kept: usize = (0..shape.len())
        .filter(|i| !dims.contains(i))
        .map(|i| shape[i])
        .product();
    let mut acc = vec![init; kept];
    let r = shape.len();
    if r == 0 {
        acc[0] = f(acc[0], x[0]);
        return acc;
    }
    let so = reduced_strides(shape, dims);
    let inner = shape[r - 1];
    let io = so[r - 1];
    let mut idx = vec![0usize; r - 1];
    let mut off = 0usize;
    for row in 0..numel(&shape[..r - 1]) {
        let xs = &x[row * inner..(row + 1) * inner];
        if io == 0 {
            let mut a = acc[off];
            for &v in xs {
                a = f(a, v);
            }
            acc[off] = a;
        } else {
            for (j, &v) in xs.iter().enumerate() {
                acc[off + j * io] = f(acc[off + j * io], v);
            }
        }
        for k in (0..r - 1).rev() {
            idx[k] += 1;
            off += so[k];
            if idx[k] < shape[k] {
                break;
            }
            off -= so[k] * shape[k];
            idx[k] = 0;
        }
    }
    acc
}

pub(super) fn sum(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let dims = c.dims(x[0].shape.len());
    let acc = reduce(x[0].f()?, &x[0].shape, &dims, 0.0f64, |a, v| {
        a + f64::from(v)
    });
    Ok(vec![Tensor::f32(
        &c.out_shape(0),
        acc.into_iter().map(|a| a as f32).collect(),
    )])
}

pub(super) fn mean(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let dims = c.dims(x[0].shape.len());
    let local: usize = dims.iter().map(|&d| x[0].shape[d]).product();
    let n = match c.int("count", 0) {
        0 => local,
        k => k as usize,
    };
    let acc = reduce(x[0].f()?, &x[0].shape, &dims, 0.0f64, |a, v| {
        a + f64::from(v)
    });
    Ok(vec![Tensor::f32(
        &c.out_shape(0),
        acc.into_iter().map(|a| (a / n as f64) as f32).collect(),
    )])
}

pub(super) fn max(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let dims = c.dims(x[0].shape.len());
    let acc = reduce(x[0].f()?, &x[0].shape, &dims, f32::NEG_INFINITY, f32::max);
    Ok(vec![Tensor::f32(&c.out_shape(0), acc)])
}

/// The gradient of `max`: `dy` flows to the elements equal to the maximum, split evenly
/// among ties (as PyTorch's `amax`).
pub(super) fn max_grad(c: &Ctx<'_>, x: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let (dy, xs) = (x[0].f()?, x[1].f()?);
    let shape = &x[1].shape;
    let dims = c.dims(shape.len());
    let mx = reduce(xs, shape, &dims, f32::NEG_INFINITY, f32::max);
    let so = reduced_strides(shape, &dims);
    let st = strides(shape);
    let out_off = |i: usize| -> usize {
        let mut rem = i;
        let mut o = 0;
        for (k, &s) in st.iter().enumerate() {
            o += (rem / s) * so[k];
            rem %= s;
        }
        o
    };
    let mut ties = vec![0u32; mx.len()];
    for (i, &v) in xs.iter().enumerate() {
        let o = out_off(i);
        if v == mx[o] {
            ties[o] += 1;
        }
    }
    let dx = xs
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let o = out_off(i);
            if v == mx[o] {
                dy[o] / ties[o] as f32
            } else {
                0.0
            }
        })
        .collect();
    Ok(vec![Tensor::f32(shape, dx)])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permute_matches_index_math() {
        let shape = [2, 3, 4];
        let x: Vec<i64> = (0..24).collect();
        let y = permute(&x, &shape, &[2, 0, 1]);
        // y[k, i, j] = x[i, j, k]
        for i in 0..2 {
            for j in 0..3 {
                for k in 0..4 {
                    assert_eq!(y[k * 6 + i * 3 + j], x[i * 12 + j * 4 + k]);
                }
            }
        }
    }

    #[test]
    fn reduce_middle_dim() {
        let x: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let s = reduce(&x, &[2, 3, 4], &[1], 0.0f32, |a, v| a + v);
        assert_eq!(s.len(), 8);
        assert_eq!(s[0], 0.0 + 4.0 + 8.0);
        assert_eq!(s[5], 13.0 + 17.0 + 21.0);
    }
}

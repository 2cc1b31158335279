//! The host backend's f32 matrix products by the `gemm` crate (single-threaded: a
//! device's steps run on one thread; ranks and processes on threads of their own), as the
//! CUDA backend gives them to cuBLAS: the generated kernels compute one dot product per
//! element, about 16 times slower than the reference runtime on a training step. A
//! product's bias is added to its rows after the sum, as the generated kernel adds it.
//! Products on bf16 buffers keep their generated kernels (the crate has no bf16).

use crate::artifact::{Gemm, Kernel};

/// `k`'s product where the BLAS takes it: a matrix product whose buffers (as compiled:
/// [`Kernel::sizes`]) are all f32.
pub(super) fn takes(k: &Kernel) -> Option<Gemm> {
    let g = k.gemm?;
    let b_count = if g.b_batched { g.batch } else { 1 };
    let bytes = |d: [u64; 3]| d.iter().try_fold(4u64, |n, &x| n.checked_mul(x));
    let mut want = vec![bytes([g.batch, g.m, g.k]), bytes([b_count, g.k, g.n])];
    if g.bias.is_some() {
        want.push(bytes([1, 1, g.n]));
    }
    want.push(bytes([g.batch, g.m, g.n]));
    let f32s =
        k.sizes.len() == want.len() && k.sizes.iter().zip(&want).all(|(&s, &w)| Some(s) == w);
    f32s.then_some(g)
}

/// `C = A B (+ bias)` for `g` on its buffers at `args` (A, B, the bias where it has one,
/// C; row-major, each stored as `g` says).
///
/// # Safety
/// `args` must hold the product's buffers, f32, of the sizes `g` gives them ([`takes`]),
/// C apart from the others, and nothing else may use them meanwhile.
pub(super) unsafe fn product(g: &Gemm, args: &[*mut u8]) {
    let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
    let (a, b) = (args[0] as *const f32, args[1] as *const f32);
    let (bias, c) = match g.bias {
        Some(_) => (Some(args[2] as *const f32), args[3] as *mut f32),
        None => (None, args[2] as *mut f32),
    };
    // Row and column strides of A ([m, k], or [k, m] stored transposed) and B ([k, n],
    // or [n, k]).
    let (a_rs, a_cs) = if g.ta { (1, m) } else { (k, 1) };
    let (b_rs, b_cs) = if g.tb { (1, k) } else { (n, 1) };
    for p in 0..g.batch as usize {
        // SAFETY: the caller's contract: every offset below stays inside its buffer.
        unsafe {
            let (ap, cp) = (a.add(p * m * k), c.add(p * m * n));
            let bp = if g.b_batched { b.add(p * k * n) } else { b };
            if k == 0 {
                std::ptr::write_bytes(cp, 0, m * n);
            } else {
                gemm::gemm(
                    m,
                    n,
                    k,
                    cp,
                    1,
                    n as isize,
                    false,
                    ap,
                    a_cs as isize,
                    a_rs as isize,
                    bp,
                    b_cs as isize,
                    b_rs as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            if let Some(bias) = bias {
                for r in 0..m {
                    for j in 0..n {
                        *cp.add(r * n + j) += *bias.add(j);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifact::BLOCK;

    fn gemm_kernel(g: Gemm, es: u64) -> Kernel {
        let b_count = if g.b_batched { g.batch } else { 1 };
        let mut sizes = vec![g.batch * g.m * g.k * es, b_count * g.k * g.n * es];
        if g.bias.is_some() {
            sizes.push(g.n * es);
        }
        sizes.push(g.batch * g.m * g.n * es);
        Kernel {
            name: "g".into(),
            len: g.batch * g.m * g.n,
            grid: 1,
            block: BLOCK,
            team: false,
            buffers: sizes.len(),
            outputs: 1,
            gemm: Some(g),
            sizes,
        }
    }

    /// Every layout the compiler gives a product (A or B stored transposed, a batch with
    /// one B or one each, a bias, nothing to sum) against the sums in f64: within f32's
    /// rounding of the sums; and only f32 products are taken.
    #[test]
    fn products_in_every_layout_match_the_sums() {
        let mut seed = 1u64;
        let mut draw = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
                })
                .collect()
        };
        for (batch, m, n, k, ta, tb, b_batched, bias) in [
            (1, 5, 7, 9, false, false, false, false),
            (1, 5, 7, 9, true, false, false, true),
            (1, 5, 7, 9, false, true, false, true),
            (3, 4, 6, 8, false, false, true, false),
            (3, 4, 6, 8, true, true, false, false),
            (2, 3, 2, 0, false, false, false, true),
        ] {
            let g = Gemm {
                batch,
                m,
                n,
                k,
                ta,
                tb,
                b_batched,
                bias: bias.then_some(0),
            };
            assert_eq!(takes(&gemm_kernel(g, 4)), Some(g));
            assert_eq!(takes(&gemm_kernel(g, 2)), None, "bf16 keeps its kernel");
            let (bu, mu, nu, ku) = (batch as usize, m as usize, n as usize, k as usize);
            let mut a = draw(bu * mu * ku);
            let mut b = draw(if b_batched { bu } else { 1 } * ku * nu);
            let mut bv = draw(nu);
            let mut c = vec![f32::NAN; bu * mu * nu];
            let mut args = vec![a.as_mut_ptr().cast::<u8>(), b.as_mut_ptr().cast::<u8>()];
            if bias {
                args.push(bv.as_mut_ptr().cast::<u8>());
            }
            args.push(c.as_mut_ptr().cast::<u8>());
            // SAFETY: the buffers hold the product's sizes, C apart from the rest.
            unsafe { product(&g, &args) };
            for p in 0..bu {
                for i in 0..mu {
                    for j in 0..nu {
                        let mut want = if bias { f64::from(bv[j]) } else { 0.0 };
                        for l in 0..ku {
                            let x = if ta {
                                a[p * mu * ku + l * mu + i]
                            } else {
                                a[p * mu * ku + i * ku + l]
                            };
                            let b0 = if b_batched { p * ku * nu } else { 0 };
                            let y = if tb {
                                b[b0 + j * ku + l]
                            } else {
                                b[b0 + l * nu + j]
                            };
                            want += f64::from(x) * f64::from(y);
                        }
                        let got = f64::from(c[p * mu * nu + i * nu + j]);
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{g:?}: [{p}][{i}][{j}] {got} against {want}"
                        );
                    }
                }
            }
        }
    }
}

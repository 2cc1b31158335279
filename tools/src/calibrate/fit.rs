//! The fits calibration makes of its timings: a matrix product's efficiency curve, and
//! least squares with non-negative coefficients (attention's costs by its heads' shapes).

/// The matrix peak and efficiency curve (`Device::matrix_efficiency`) from products
/// `(flops, seconds)` each timed with its dispatch, the per-op overhead `dispatch` (what
/// the model charges every op besides): a product's rate is its FLOPs over its time less
/// the dispatch, that time kept to at least a quarter of the whole (small products, whose
/// time is mostly dispatch, would otherwise pass for the fastest), the peak the best
/// rate, and each point's efficiency its rate over the peak. The model then predicts each
/// product at its measured time.
pub(super) fn efficiency_curve(products: &[(f64, f64)], dispatch: f64) -> (f64, Vec<[f64; 2]>) {
    let rates: Vec<(f64, f64)> = products
        .iter()
        .map(|&(flops, t)| (flops, flops / (t - dispatch).max(t / 4.0)))
        .collect();
    let peak = rates.iter().map(|r| r.1).fold(0.0f64, f64::max);
    (peak, rates.iter().map(|&(f, r)| [f, r / peak]).collect())
}

/// Non-negative least squares on the relative error, `min sum ((x . c - t) / t)^2` over
/// `c >= 0`, for a few terms: the best of the unconstrained solutions over every subset
/// of the terms (the others 0) that come out non-negative. `None` when no subset does.
pub(super) fn nonnegative_fit<const N: usize>(rows: &[([f64; N], f64)]) -> Option<[f64; N]> {
    let mut best: Option<([f64; N], f64)> = None;
    for mask in 1u32..(1 << N) {
        let keep: Vec<usize> = (0..N).filter(|i| mask & (1 << i) != 0).collect();
        let m = keep.len();
        // Normal equations of the weighted rows over the kept terms.
        let mut a = vec![vec![0.0; m + 1]; m];
        for (x, t) in rows {
            let w: Vec<f64> = keep.iter().map(|&i| x[i] / t).collect();
            for r in 0..m {
                for c in 0..m {
                    a[r][c] += w[r] * w[c];
                }
                a[r][m] += w[r];
            }
        }
        // Each term scaled to unit norm: the terms' sizes differ by orders of magnitude.
        let norm: Vec<f64> = (0..m).map(|r| a[r][r].sqrt().max(1e-300)).collect();
        for r in 0..m {
            for c in 0..m {
                a[r][c] /= norm[r] * norm[c];
            }
            a[r][m] /= norm[r];
        }
        let Some(sol) = solve(a) else { continue };
        let sol: Vec<f64> = sol.iter().zip(&norm).map(|(v, n)| v / n).collect();
        if sol.iter().any(|&v| v < 0.0) {
            continue;
        }
        let mut c = [0.0; N];
        for (k, &i) in keep.iter().enumerate() {
            c[i] = sol[k];
        }
        let err: f64 = rows
            .iter()
            .map(|(x, t)| (dot(x, &c) / t - 1.0).powi(2))
            .sum();
        if best.as_ref().is_none_or(|(_, e)| err < *e) {
            best = Some((c, err));
        }
    }
    best.map(|(c, _)| c)
}

pub(super) fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The solution of the augmented square system `a` (Gaussian elimination with partial
/// pivoting); `None` when it is singular.
pub(super) fn solve(mut a: Vec<Vec<f64>>) -> Option<Vec<f64>> {
    let m = a.len();
    for col in 0..m {
        let p = (col..m).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[p][col].abs() < 1e-300 {
            return None;
        }
        a.swap(col, p);
        let pivot = a[col].clone();
        for (r, row) in a.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot[col];
                for (x, p) in row[col..].iter_mut().zip(&pivot[col..]) {
                    *x -= f * p;
                }
            }
        }
    }
    Some((0..m).map(|r| a[r][m] / a[r][r]).collect())
}

/// `head_kernels`' four coefficients fitted to `rows` (each `cost::head_terms` of a shape
/// and its seconds) by [`nonnegative_fit`], and the fit's largest relative error over them.
pub(super) fn fit_heads(rows: &[([f64; 4], f64)]) -> Option<([f64; 4], f64)> {
    let coef = nonnegative_fit(rows)?;
    let worst = rows
        .iter()
        .map(|(x, t)| (dot(x, &coef) / t - 1.0).abs())
        .fold(0.0, f64::max);
    Some((coef, worst))
}

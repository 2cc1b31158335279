//! Unit tests of `calibrate`.

use super::*;

#[test]
fn nonnegative_fit_recovers_terms_and_drops_negative_ones() {
    // Exact data from known coefficients of very different sizes.
    let c = [1e-6, 1e-7, 4e-9, 8e-11];
    let rows: Vec<([f64; 4], f64)> = [
        (8.0, 4.0),
        (16.0, 16.0),
        (64.0, 32.0),
        (128.0, 8.0),
        (32.0, 64.0),
    ]
    .iter()
    .map(|&(s, d): &(f64, f64)| {
        let x = [1.0, s, s * s, s * s * d];
        (x, x.iter().zip(&c).map(|(a, b)| a * b).sum())
    })
    .collect();
    let got = nonnegative_fit(&rows).expect("a fit");
    for (g, w) in got.iter().zip(&c) {
        assert!((g / w - 1.0).abs() < 1e-6, "{got:?}");
    }
    // A time that falls with the second term: its coefficient would be negative, so
    // the fit leaves it out and stays non-negative.
    let rows: Vec<([f64; 2], f64)> = (1..6)
        .map(|k| {
            let x = [1.0, k as f64];
            (x, 10.0 - k as f64)
        })
        .collect();
    let got = nonnegative_fit(&rows).expect("a fit");
    assert_eq!(got[1], 0.0);
    assert!(got[0] > 0.0);
}

#[test]
fn efficiency_curve_takes_the_dispatch_out() {
    // Products timed at a dispatch plus their FLOPs at a rate that grows with size;
    // the smallest is almost all dispatch.
    let (dispatch, peak) = (1e-6, 50e9);
    let truth = [(1e3, 0.5), (4e3, 0.2), (3e5, 0.8), (3e7, 1.0), (3e8, 0.9)];
    let timed: Vec<(f64, f64)> = truth
        .iter()
        .map(|&(f, e)| (f, dispatch + f / (peak * e)))
        .collect();
    let (p, curve) = efficiency_curve(&timed, dispatch);
    assert!((p / peak - 1.0).abs() < 1e-9, "{p}");
    for (((f, e), [g, got]), &(_, t)) in truth.iter().zip(&curve).zip(&timed) {
        assert_eq!(f, g);
        // The model's time (dispatch + FLOPs at the curve's rate): the measured one,
        // except where the dispatch is over three quarters of it, whose compute is
        // kept to a quarter (charged more, never passing for the peak).
        let model = dispatch + f / (p * got);
        if dispatch < 0.75 * t {
            assert!((got / e - 1.0).abs() < 1e-9, "{f}: {got} against {e}");
            assert!((model / t - 1.0).abs() < 1e-9, "{f}: {model} against {t}");
        } else {
            assert!(model > t && *got < 1.0, "{f}: {got}, {model} against {t}");
        }
    }
}

/// Two chains of bf16 products of one size differ by their extra products alone: the
/// casts and launches they share cancel.
#[test]
fn bf16_products_are_the_chains_difference() {
    use super::gpu::bf16_products;
    // Products of 2e9 FLOPs at 1e12 FLOP/s (2 ms each) after 5 ms of casts, and one size
    // timed too noisily to tell (the longer chain barely slower): a quarter of its time
    // a product.
    let rows = [
        (2e9, 1, 5e-3 + 2e-3),
        (9.0 * 2e9, 9, 5e-3 + 9.0 * 2e-3),
        (2e6, 1, 1e-3),
        (9.0 * 2e6, 9, 1.001e-3),
    ];
    let got = bf16_products(&rows);
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].0, 2e6);
    assert!((got[0].1 - 1.001e-3 / 9.0 / 4.0).abs() < 1e-12, "{got:?}");
    assert_eq!(got[1].0, 2e9);
    assert!((got[1].1 - 2e-3).abs() < 1e-12, "{got:?}");
}

//! Branch-free f32 math that the compiler vectorizes (libm calls are scalar).

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// 1.5 * 2^23: adding and subtracting it rounds an f32 to the nearest integer.
const ROUND: f32 = 12_582_912.0;

/// e^x with a relative error below 3e-7 for normal results; 0 below -104 and +inf above
/// ln(f32::MAX), as libm saturates.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let c = x.clamp(-104.0, 88.72);
    let n = (c * LOG2E + ROUND) - ROUND;
    let r = c - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // 2^n in two factors, so that n from -150 to 128 never leaves the normal exponents.
    // SAFETY: `c` is clamped to [-104, 88.72], so `n` is an integer in [-151, 128].
    let ni: i32 = unsafe { n.to_int_unchecked() };
    let n1 = ni >> 1;
    let s1 = f32::from_bits(((n1 + 127) << 23) as u32);
    let s2 = f32::from_bits(((ni - n1 + 127) << 23) as u32);
    let v = p * s1 * s2;
    if x < -104.0 {
        0.0
    } else if x > 88.72 {
        f32::INFINITY
    } else {
        v
    }
}

/// erf(x) (Abramowitz & Stegun 7.1.26; absolute error below 1e-6 in f32), with `exp(-x*x)`, which
/// the Gaussian's density reuses.
#[inline(always)]
pub fn erf_and_gauss(x: f32) -> (f32, f32) {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t
        * (0.254_829_6
            + t * (-0.284_496_74 + t * (1.421_413_7 + t * (-1.453_152_1 + t * 1.061_405_4))));
    let g = exp(-a * a);
    ((1.0 - poly * g).copysign(x), g)
}

/// 1 / (1 + e^-x).
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `f` over every element, in a loop compiled for AVX2 when the CPU has it (8 lanes instead
/// of SSE2's 4; the baseline x86-64 target only promises SSE2).
pub fn map1(x: &[f32], f: impl Fn(f32) -> f32 + Copy) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    map1_into(x, &mut out, f);
    out
}

/// [`map1`] into `out` (of `x`'s length).
pub fn map1_into(x: &[f32], out: &mut [f32], f: impl Fn(f32) -> f32 + Copy) {
    assert_eq!(x.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        unsafe { map1_avx2(x, out, f) };
        return;
    }
    map1_any(x, out, f);
}

/// `f(a, b)` over pairs of elements (equal lengths), AVX2 when available.
pub fn map2(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32 + Copy) -> Vec<f32> {
    let mut out = vec![0.0f32; a.len()];
    map2_into(a, b, &mut out, f);
    out
}

/// [`map2`] into `out` (all three of one length).
pub fn map2_into(a: &[f32], b: &[f32], out: &mut [f32], f: impl Fn(f32, f32) -> f32 + Copy) {
    assert!(a.len() == b.len() && a.len() == out.len());
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        unsafe { map2_avx2(a, b, out, f) };
        return;
    }
    map2_any(a, b, out, f);
}

#[inline(always)]
fn map1_any(x: &[f32], out: &mut [f32], f: impl Fn(f32) -> f32) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = f(v);
    }
}

#[inline(always)]
fn map2_any(a: &[f32], b: &[f32], out: &mut [f32], f: impl Fn(f32, f32) -> f32) {
    for ((o, &p), &q) in out.iter_mut().zip(a).zip(b) {
        *o = f(p, q);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn map1_avx2(x: &[f32], out: &mut [f32], f: impl Fn(f32) -> f32) {
    map1_any(x, out, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn map2_avx2(a: &[f32], b: &[f32], out: &mut [f32], f: impl Fn(f32, f32) -> f32) {
    map2_any(a, b, out, f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_libm() {
        let mut worst = 0.0f64;
        for i in -870_000..=887_000 {
            let x = i as f32 * 1e-4;
            let want = libm::exp(f64::from(x));
            let got = f64::from(exp(x));
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp(-110.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn erf_matches_libm() {
        let mut worst = 0.0f64;
        for i in -6000..=6000 {
            let x = i as f32 * 1e-3;
            let (e, _) = erf_and_gauss(x);
            worst = worst.max((f64::from(e) - libm::erf(f64::from(x))).abs());
        }
        assert!(worst < 1e-6, "worst {worst}");
    }
}

//! What the formulas mean on a CPU, in f32: branch-free math that the compiler vectorizes
//! (libm calls are scalar; these are the algorithms the code generator emits too), the
//! loops that map a formula over slices, and [`Scalar`] for `f32`, the instantiation of every
//! formula that the CPU runtime runs.

use super::{round_bf16, Scalar};

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
    let g = exp(-(a * a));
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

/// A formula's value: every function as the CPU runtime computes it.
impl Scalar for f32 {
    #[inline(always)]
    fn c(v: f32) -> f32 {
        v
    }
    #[inline(always)]
    fn exp(self) -> f32 {
        exp(self)
    }
    #[inline(always)]
    fn ln(self) -> f32 {
        f32::ln(self)
    }
    #[inline(always)]
    fn sqrt(self) -> f32 {
        f32::sqrt(self)
    }
    #[inline(always)]
    fn tanh(self) -> f32 {
        f32::tanh(self)
    }
    #[inline(always)]
    fn erf(self) -> f32 {
        erf_and_gauss(self).0
    }
    #[inline(always)]
    fn abs(self) -> f32 {
        f32::abs(self)
    }
    #[inline(always)]
    fn round_bf16(self) -> f32 {
        round_bf16(self)
    }
    #[inline(always)]
    fn max(self, other: f32) -> f32 {
        f32::max(self, other)
    }
    #[inline(always)]
    fn if_gt(self, rhs: f32, then: f32, otherwise: f32) -> f32 {
        if self > rhs {
            then
        } else {
            otherwise
        }
    }
}

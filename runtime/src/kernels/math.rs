//! The f32 math of the kernels: the functions the formulas mean on a CPU
//! ([`nnscaler_dialects::scalar::cpu`], one definition for the runtime and the formulas'
//! f32 instantiation), tested here against libm.

pub use nnscaler_dialects::scalar::cpu::{
    erf_and_gauss, exp, map1, map1_into, map2, map2_into, sigmoid,
};

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

//! How f32 matrix products may round on the GPU, process-wide, as PyTorch's
//! `torch.set_float32_matmul_precision`: `highest` (the default) computes them in f32
//! (cuBLAS's `CUBLAS_COMPUTE_32F`, no TF32: the CPU reference's products within
//! summation order); `high` lets cuBLAS use TF32 tensor cores (`CUBLAS_COMPUTE_32F_FAST_TF32`:
//! inputs rounded to 10 mantissa bits, f32 sums), several times faster and about 1e-3
//! relative from f32. bf16 products are bf16 on tensor cores either way; the host
//! backend computes in f32 either way (PyTorch's CPU products ignore the setting too).

use std::sync::atomic::{AtomicBool, Ordering};

static TF32: AtomicBool = AtomicBool::new(false);

/// A matrix-product precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulPrecision {
    /// f32 products in f32.
    Highest,
    /// f32 products may use TF32.
    High,
}

impl std::str::FromStr for MatmulPrecision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "highest" => Ok(MatmulPrecision::Highest),
            "high" => Ok(MatmulPrecision::High),
            _ => Err(format!(
                "'{s}' is not a matrix-product precision: highest (f32) or high (TF32 on the GPU)"
            )),
        }
    }
}

/// Sets the process's precision for f32 matrix products (before loading programs).
pub fn set(p: MatmulPrecision) {
    TF32.store(p == MatmulPrecision::High, Ordering::Relaxed);
}

/// Whether f32 products may use TF32.
pub fn tf32() -> bool {
    TF32.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precisions_parse_and_others_are_named() {
        assert_eq!("high".parse::<MatmulPrecision>(), Ok(MatmulPrecision::High));
        assert_eq!(
            "highest".parse::<MatmulPrecision>(),
            Ok(MatmulPrecision::Highest)
        );
        let e = "medium".parse::<MatmulPrecision>().unwrap_err();
        assert!(e.contains("'medium'") && e.contains("highest"), "{e}");
    }
}

//! Seeded, counter-based random numbers: `nnscaler-rt`'s ([`nnscaler_rt::rng`]), so the
//! reference runtime and the thin runtime (which draws a training bundle's initial
//! parameters and batches) draw the same numbers.

pub use nnscaler_rt::rng::*;

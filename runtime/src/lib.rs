//! The CPU reference runtime of nnscaler.
//!
//! * [`tensor`]: owned row-major tensors (f32 floats, i64 integers);
//! * [`kernels`]: a CPU kernel for every `dnn` op, forward and backward, keyed by op name
//!   (matrix products through the `gemm` crate);
//! * [`interp`]: executes a [`nnscaler_dialects::graph::Graph`], binds named tensors to
//!   arguments;
//! * [`memory`]: the memory a run needs, checked against what the process may use;
//! * [`io`]: safetensors files; [`init`] and [`rng`]: seeded, order-independent random
//!   numbers for parameters and dropout.
pub mod alloc;
pub mod ckernel;
pub mod init;
pub mod interp;
pub mod io;
pub mod kernels;
pub mod memory;
pub mod rng;
pub mod spmd;
pub mod tensor;

pub use interp::{run, run_profiled, Options, Profile, RunError};
pub use tensor::Tensor;

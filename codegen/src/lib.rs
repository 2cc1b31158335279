//! GPU kernels for `dnn` ops, generated as LLVM IR with inkwell and lowered two ways: to PTX
//! for NVIDIA GPUs (LLVM's NVPTX back end, `ptx_kernel` entries, global pointers in address
//! space 1) and JIT-compiled for the host CPU, where every kernel is tested against the CPU
//! runtime's reference kernels (so the generator is tested on machines without a GPU).
//!
//! * [`kernel`]: what a kernel computes (elementwise formulas from the ops' specs) and
//!   how a function's elementwise ops fuse into kernels;
//! * [`llvm`]: the IR: one body per kernel, math functions with the runtime's algorithms,
//!   and the PTX and host entry points;
//! * [`target`]: PTX text for a GPU ([`target::Gpu`]), or host-JIT kernels.
//!
//! Not built yet (issue 13): row kernels (reductions, softmax, norms), attention,
//! embedding, dropout, the optimizer ops, matrix products through cuBLAS, the artifact and
//! its runtime.

pub mod kernel;
pub mod llvm;
pub mod target;

pub use kernel::{fuse, Elementwise, Group};
pub use target::{llvm_ir, ptx, Gpu, HostKernels};

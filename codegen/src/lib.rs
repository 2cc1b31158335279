//! GPU kernels for `dnn` ops, generated as LLVM IR with inkwell and lowered two ways: to PTX
//! for NVIDIA GPUs (LLVM's NVPTX back end, `ptx_kernel` entries, global pointers in address
//! space 1) and JIT-compiled for the host CPU, where every kernel is tested against the CPU
//! runtime's reference kernels (so the generator is tested on machines without a GPU).
//!
//! * [`kernel`]: what a kernel computes (elementwise formulas from the ops' specs) and
//!   how a function's elementwise ops fuse into kernels;
//! * [`llvm`]: the IR: one body per kernel, math functions with the runtime's algorithms,
//!   and the PTX and host entry points;
//! * [`program`]: a whole function as launches (calls inlined, a pipeline rank's sends
//!   and receives as steps);
//! * [`artifact`]: a function, or a pipeline's programs, compiled to an `.nnsx` artifact
//!   (PTX, host shared object, launch plans, memory plans) for `nnscaler-rt`;
//! * [`target`]: PTX text for a GPU ([`target::Gpu`]), or host-JIT kernels that run an
//!   op's or a whole function's launches.
//!
//! Covered: every elementwise op (fused), reductions, the softmax family, transpose,
//! reshape, matrix products, attention and its gradient, layer and RMS norm with their
//! gradients, embedding and its gradient, cross-entropy and its gradient, AdamW and
//! clipping's factor, rotary, dropout, the vocabulary-parallel pieces,
//! slice, pad, concat, split, broadcast_to, max_grad: every dnn op ([`kernel::covered`]).
//! Reductions along lines of 64 or more elements are team kernels (one GPU block per
//! line, `llvm/team/`); attention is FlashAttention-2 (team kernels staging key/value or
//! query tiles in shared memory, an online softmax in registers, `llvm/tiles.rs`), its
//! bf16 forward and backward on tensor cores (`mma.sync`, emulated lane by lane on the
//! host, `llvm/mma/`), and f32 the same way as three TF32 products where
//! `NNSCALER_ATTN_F32=tf32x3` asks for it. Not built yet: elementwise chains at HBM speed
//! (issue 40).

pub mod artifact;
pub mod kernel;
pub mod llvm;
pub mod program;
pub mod target;

pub use artifact::{artifact, pipeline_artifact};
pub use kernel::{covered, fuse, lower, Body, Buf, Elt, Group, Kernel, Lowered, Slot};
pub use program::{compile, compile_on, inline, BufId, Collective, Devices, Launch, Program, Work};
pub use target::{host_shared_object, llvm_ir, ptx, Data, Gpu, HostKernels};

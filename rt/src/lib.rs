//! `nnscaler-rt`: the thin runtime of compiled nnscaler programs.
//!
//! It reads `.nnsx` artifacts ([`artifact`]: the format, versioned and checksummed) and
//! runs their launch plans (one program on every device, or a pipeline's programs, one
//! per rank, under one scheduler). It has no MLIR or LLVM inside, so the binary can be copied to
//! a GPU machine alone. Backends: [`host`] (the artifact's kernels compiled for the CPU,
//! loaded with `dlopen`), where the launch plan is tested against the reference runtime,
//! and, with the `cuda` feature, [`cuda`] (the PTX through the driver API, matrix
//! products through cuBLAS). Both run collectives as the same moves (`collective`):
//! strided copies between the virtual devices' arenas and the artifact's reducer kernels.
//! As ranks (`ranks`: a thread per device), the host runs an in-process communicator, the
//! CUDA backend NCCL with a GPU per device ([`nccl`]) or a stream per device on one GPU
//! ([`streams`]).
//!
//! It also trains: [`train`] is the training loop `nnscaler train` and `nnscaler-rt train`
//! share, and the training bundles the latter runs; [`session`] keeps a step's state where
//! it runs between steps; [`net`] and [`procs`] make it one of several processes started by
//! torchrun or Slurm; [`data`], [`rng`] and [`plot`] are its batches, random numbers and
//! loss curve.

pub mod artifact;
pub mod bench;
pub mod board;
mod collective;
#[cfg(any(test, feature = "cuda"))]
pub mod compare;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
pub mod host;
pub mod memory;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod net;
pub mod plot;
pub mod precision;
pub mod procs;
pub mod profile;
mod ranks;
pub mod rng;
pub mod session;
#[cfg(feature = "cuda")]
pub mod streams;
pub mod tensor;
pub mod train;

pub use artifact::{Artifact, Header, MAGIC, VERSION};
pub use collective::{Collective, Elem, Param, ParamKind};
pub use host::HostProgram;
pub use ranks::lanes;
pub use tensor::{Data, Tensor};

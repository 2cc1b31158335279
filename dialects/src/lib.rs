//! The `dnn` (compute) and `nns` (distribution) dialects of nnscaler.
//!
//! The IR is real MLIR (through `melior`): our ops are written in generic form with
//! unregistered dialects allowed, and their definitions live here in Rust:
//!
//! * [`annotation`]: nnScaler's dimension-annotation language (`m k+, k+ n -> m n`);
//! * [`spec`] and [`dnn`]: one [`spec::OpSpec`] per compute op (operands, attributes,
//!   annotation, result types, cost);
//! * [`nns`]: meshes, R/V/D layouts, split directives, collectives;
//! * [`verify`]: checks a module against all of the above, reporting every problem;
//! * [`builder`]: typed builders, so no caller writes attribute strings;
//! * [`scalar`]: elementwise ops' formulas, for kernel generators;
//! * [`graph`]: a function as an SSA graph, written back in place through [`rewriter`];
//! * [`domain`]: what values an argument may hold (ids below a table's rows, AdamW's step);
//! * [`context`] and [`diag`]: the MLIR context owner and located diagnostics.
pub mod annotation;
pub mod builder;
pub mod context;
pub mod diag;
pub mod dnn;
pub mod domain;
pub mod graph;
pub mod irdl;
pub mod nns;
pub mod nns_attrs;
pub mod rewriter;
pub mod scalar;
pub mod sharding;
pub mod spec;
pub mod types;
pub mod userop;
pub mod verify;
pub mod view;
pub mod vjp;

//! nnscaler-tools' integration tests, in one binary: each links MLIR and LLVM (about 110 MB
//! of code), so one binary per file cost a link and that much disk apiece. Run one part with
//! `cargo test -p nnscaler-tools --test integration equivalence::` (a module's name).
//! `lit.rs` and `train_kill.rs` drive the built binaries, link neither, and stay apart.

// The binaries' directory, nnscaler-rt built in it (shared with lit.rs, docs_commands.rs).
#[path = "../support/bins.rs"]
#[allow(dead_code)]
mod bins;
mod common;

mod coverage;
mod docs;
mod equivalence;
mod fuzz;
mod oracle_models;
mod oracle_ops;
mod oracle_optimizer;
mod plan_search;
mod split_search;

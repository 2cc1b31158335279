//! nnscaler's passes and the pass registry.
//!
//! Laid out as the pipeline is: the pass machinery at the top (`pass` the interface,
//! `registry` the single name table that the `nnscaler-opt` flags, `--list-passes`,
//! `--help` and `--pass-pipeline` are generated from, `pipeline` the runner, `rewrite`
//! running a function pass in place, `external` and `capi` for other hosts; `layouts`
//! what the layout passes share), the passes in `transforms/` (one module per flag), and
//! what plans are chosen with in `planner/`.

pub mod capi;
pub mod external;
pub mod layouts;
pub mod pass;
pub mod pipeline;
pub mod planner;
pub mod registry;
pub mod rewrite;
pub mod transforms;

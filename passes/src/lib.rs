//! nnscaler's passes and the pass registry.
//!
//! Each pass is one file with a thin driver; [`registry`] is the single name table that the
//! `nnscaler-opt` flags, `--list-passes`, `--help` and `--pass-pipeline` are generated from.

pub mod autocast;
pub mod autodiff;
pub mod capi;
pub mod cost;
pub mod external;
pub mod layer_runs;
pub mod layouts;
pub mod localize;
pub mod lower_relayouts;
pub mod mpmd;
pub mod optimizer;
pub mod pass;
pub mod pipeline;
pub mod place;
pub mod place_z3;
pub mod plan;
pub mod plan_search;
pub mod policies;
pub mod print_stats;
pub mod propagate_layouts;
pub mod recompute;
pub mod registry;
pub mod rewrite;
pub mod schedule;
pub mod search;
pub mod split_problem;
pub mod split_search;
pub mod split_tensor;
pub mod timeline;

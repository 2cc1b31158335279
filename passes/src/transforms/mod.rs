//! The passes that transform a program, one module per flag (`--autodiff` is
//! `autodiff.rs`, the `--schedule-*` passes are `schedule/`), in the order a training
//! pipeline runs them: `autocast`, `autodiff`, `recompute`, `optimizer`, `place`, `plan`,
//! `propagate_layouts`, `split_tensor`, `schedule`, `lower_relayouts`, `localize`; and
//! `print_stats`, which reports and changes nothing.

pub mod autocast;
pub mod autodiff;
pub mod localize;
pub mod lower_relayouts;
pub mod optimizer;
pub mod place;
pub mod plan;
pub mod print_stats;
pub mod propagate_layouts;
pub mod recompute;
pub mod schedule;
pub mod split_tensor;

//! What plans are chosen with: the cost model (`cost`), pipeline schedules as data and
//! their simulation (`schedule`, `timeline`), the named policies' directives (`policies`),
//! placement's Z3 problem (`place_z3`), the per-op split search behind `--plan=tp-search`
//! (`split_search`, `split_problem`), the layer-wise plan search behind `nnscaler plan`
//! (`search`, with `layer_runs` profiling one block per run of identical layers) and
//! `--plan=auto` on top of it (`plan_search`).

pub mod cost;
pub mod layer_runs;
pub mod place_z3;
pub mod plan_search;
pub mod policies;
pub mod schedule;
pub mod search;
pub mod split_problem;
pub mod split_search;
pub mod timeline;

//! Parameter initialization: seeded, reproducible, and independent of argument order.
//!
//! Each parameter draws from its own stream (a hash of its name) under the run's seed, so
//! adding or reordering parameters never changes the others' values. The default is
//! normal(0, 0.02), except for the weights of `layer_norm`/`rms_norm` (ones) and biases of
//! `linear`/`layer_norm` (zeros), as in GPT-2 and Llama. An `nns.init` argument attribute
//! overrides the rule for one parameter: `"normal(mean, std)"`, `"uniform(lo, hi)"`,
//! `"zeros"`, `"ones"` or `"const(v)"`.

use crate::tensor::{dims, Tensor};
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::types::Init;

/// Argument `arg` of `g` as training state: its name, shape and initialization rule.
pub fn state_spec(g: &Graph, arg: usize) -> Result<nnscaler_rt::train::StateSpec, String> {
    use nnscaler_rt::train::{Init as Rule, StateSpec};
    let a = &g.args[arg];
    let name = a.name().unwrap_or("").to_string();
    let init = match g.init_rule(arg).map_err(|e| format!("'{name}': {e}"))? {
        Init::Const(value) => Rule::Const { value },
        Init::Normal { mean, std } => Rule::Normal { mean, std },
        Init::Uniform { lo, hi } => Rule::Uniform { lo, hi },
    };
    Ok(StateSpec {
        name,
        shape: dims(&g.values[a.value]).iter().map(|&d| d as u64).collect(),
        init,
    })
}

/// Draws parameter argument `arg` of `g` under `seed` (the draw `nnscaler-rt` makes of a
/// training bundle's state: [`nnscaler_rt::train::StateSpec::draw`]).
pub fn init_param(g: &Graph, arg: usize, seed: u64) -> Result<Tensor, String> {
    state_spec(g, arg)?.draw(seed)
}

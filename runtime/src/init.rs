//! Parameter initialization: seeded, reproducible, and independent of argument order.
//!
//! Each parameter draws from its own stream (a hash of its name) under the run's seed, so
//! adding or reordering parameters never changes the others' values. The default is
//! normal(0, 0.02), except for the weights of `layer_norm`/`rms_norm` (ones) and biases of
//! `linear`/`layer_norm` (zeros), as in GPT-2 and Llama. An `nns.init` argument attribute
//! overrides the rule for one parameter: `"normal(mean, std)"`, `"uniform(lo, hi)"`,
//! `"zeros"`, `"ones"` or `"const(v)"`.

use crate::rng;
use crate::tensor::{dims, numel, Tensor};
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::nns::Init;

/// Draws parameter argument `arg` of `g` under `seed`.
pub fn init_param(g: &Graph, arg: usize, seed: u64) -> Result<Tensor, String> {
    let a = &g.args[arg];
    let name = a.name().unwrap_or("");
    let shape = dims(&g.values[a.value]);
    let stream = rng::name_stream(name);
    let n = numel(&shape) as u64;
    let v: Vec<f32> = match g.init_rule(arg)? {
        Init::Const(c) => vec![c as f32; n as usize],
        Init::Normal { mean, std } => (0..n)
            .map(|i| (mean + std * rng::normal(seed, stream, i)) as f32)
            .collect(),
        Init::Uniform { lo, hi } => (0..n)
            .map(|i| (lo + (hi - lo) * rng::uniform(seed, stream, i)) as f32)
            .collect(),
    };
    Ok(Tensor::f32(&shape, v))
}

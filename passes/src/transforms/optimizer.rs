//! `--optimizer{kind=adamw ...}`: turns a training step's gradients into the optimizer's
//! update, in the IR, so every later pass partitions the update like any other op.
//!
//! Input: a function returning its loss and `grad.<name>` of each parameter (`--autodiff`).
//! Output: the whole step, `(parameters, data, optimizer state, step, lr) -> (loss, next
//! parameters, next state)`:
//! * for each parameter `p`, arguments `adam.m.<p>` and `adam.v.<p>` (its moments; same
//!   type, `nns.state_of = "<p>"` so `--plan` gives them the parameter's layout, and
//!   `nns.init = "zeros"` so a first step starts from zero), then the scalars `step`
//!   (counting from 1) and `lr` (the learning rate: schedules live in the trainer);
//! * with `clip=C > 0`, global-norm clipping as `torch.nn.utils.clip_grad_norm_`: the sum
//!   of every gradient's squares, `dnn.clip_scale` (min(1, C / (norm + 1e-6))), which
//!   every update applies to its gradient (`dnn.adamw`'s `scale` operand; on sharded
//!   gradients the sum's all_reduce comes from the layouts, like any reduction);
//! * one `dnn.adamw` per parameter (`torch.optim.AdamW`), weight decay only on parameters
//!   of rank 2 or more (matrices and embeddings; norms and biases get none, as nanoGPT
//!   groups them), or, with `no_decay=PATTERNS` (comma-separated, `*` matching any run of
//!   characters), on every parameter whose name matches none of them;
//! * every `dnn.dropout` (forward and backward) reads `step`, so each step draws a new
//!   mask;
//! * results: the loss, then per parameter `next.<p>`, `next.adam.m.<p>`,
//!   `next.adam.v.<p>` (the gradients are no longer results).

use crate::layouts::error;
use crate::pass::{FunctionPass, PassOptions};
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::{Graph, Output, ValueId};
use nnscaler_dialects::types::{AttrValue, Attrs, Elem, TensorType};

/// The pass.
#[derive(Debug)]
pub struct Optimizer {
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    clip: f64,
    /// Name patterns of the parameters without weight decay (`None`: by rank).
    no_decay: Option<Vec<String>>,
}

/// Whether `name` matches `pattern`, where `*` matches any run of characters.
pub fn glob(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || name.len() < first.len() + last.len() || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(i) => rest = &rest[i + part.len()..],
            None => return false,
        }
    }
    true
}

impl Optimizer {
    /// Options: `kind` (adamw), `beta1`, `beta2`, `eps`, `weight_decay`, `clip`,
    /// `no_decay`.
    pub fn new(o: &PassOptions) -> Result<Self, String> {
        match o.get("kind").unwrap_or("adamw") {
            "adamw" => {}
            other => return Err(format!("optimizer: unknown kind '{other}' (kinds: adamw)")),
        }
        let num =
            |k: &str, default: f64, ok: &dyn Fn(f64) -> bool, what: &str| -> Result<f64, String> {
                match o.get(k) {
                    None => Ok(default),
                    Some(v) => v
                        .parse::<f64>()
                        .ok()
                        .filter(|x| x.is_finite() && ok(*x))
                        .ok_or(format!("optimizer: '{k}={v}' must be {what}")),
                }
            };
        let unit = |x: f64| (0.0..1.0).contains(&x);
        Ok(Optimizer {
            beta1: num("beta1", 0.9, &unit, "in [0, 1)")?,
            beta2: num("beta2", 0.999, &unit, "in [0, 1)")?,
            eps: num("eps", 1e-8, &|x| x > 0.0, "a number > 0")?,
            weight_decay: num("weight_decay", 0.01, &|x| x >= 0.0, "a number >= 0")?,
            clip: num("clip", 0.0, &|x| x >= 0.0, "a number >= 0 (0: no clipping)")?,
            no_decay: match o.get("no_decay") {
                None => None,
                Some(v) => {
                    let pats: Vec<String> = v
                        .split(',')
                        .map(str::trim)
                        .filter(|p| !p.is_empty())
                        .map(str::to_string)
                        .collect();
                    if pats.is_empty() {
                        return Err(format!(
                            "optimizer: 'no_decay={v}' names no pattern (e.g. no_decay=*.bias,*ln_*)"
                        ));
                    }
                    Some(pats)
                }
            },
        })
    }
}

fn attrs(items: &[(&str, AttrValue)]) -> Attrs {
    items
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

fn scalar() -> TensorType {
    TensorType {
        shape: Vec::new(),
        elem: Elem::F32,
    }
}

impl FunctionPass for Optimizer {
    fn run_on_function(&mut self, g: Graph) -> Result<Option<Graph>, Diagnostics> {
        if g.is_localized() {
            return Err(error(
                &g.loc,
                "optimizer: the function is localized; add the optimizer before --localize",
            ));
        }
        if g.args.iter().any(|a| a.attrs.contains_key("nns.state_of")) {
            return Err(error(
                &g.loc,
                format!("optimizer: @{} already has an optimizer", g.name),
            ));
        }
        // Each gradient result and its parameter.
        let mut pairs: Vec<(usize, ValueId)> = Vec::new();
        for o in &g.outputs {
            let Some(p) = o.name().and_then(|n| n.strip_prefix("grad.")) else {
                continue;
            };
            let arg = g
                .args
                .iter()
                .position(|a| a.is_param() && a.name() == Some(p))
                .ok_or_else(|| {
                    error(
                        &g.loc,
                        format!(
                            "optimizer: result 'grad.{p}' names no parameter of @{}",
                            g.name
                        ),
                    )
                })?;
            pairs.push((arg, o.value));
        }
        if pairs.is_empty() {
            return Err(error(
                &g.loc,
                format!(
                    "optimizer: @{} returns no gradients; run --autodiff first",
                    g.name
                ),
            ));
        }
        let loss = g
            .outputs
            .iter()
            .find(|o| !o.name().is_some_and(|n| n.starts_with("grad.")))
            .cloned()
            .ok_or_else(|| error(&g.loc, format!("optimizer: @{} returns no loss", g.name)))?;
        let mut out = g.clone();
        let loc = g.loc.clone();
        let name_of = |arg: usize| g.args[arg].name().unwrap_or("").to_string();
        // The state and the scalars.
        let mut states = Vec::new();
        for &(arg, _) in &pairs {
            let ty = g.values[g.args[arg].value].clone();
            let p = name_of(arg);
            let state = |kind: &str| {
                attrs(&[
                    ("nns.name", AttrValue::Str(format!("adam.{kind}.{p}"))),
                    ("nns.state_of", AttrValue::Str(p.clone())),
                    ("nns.init", AttrValue::Str("zeros".into())),
                ])
            };
            let m = out.add_arg(ty.clone(), state("m"));
            let v = out.add_arg(ty, state("v"));
            states.push((m, v));
        }
        let step = out.add_arg(
            scalar(),
            attrs(&[("nns.name", AttrValue::Str("step".into()))]),
        );
        let lr = out.add_arg(
            scalar(),
            attrs(&[("nns.name", AttrValue::Str("lr".into()))]),
        );
        // Dropout draws a new mask each step: every dropout (forward and backward, which
        // must agree) reads the step.
        for n in &mut out.nodes {
            if n.op == "dnn.dropout" && n.inputs.len() == 1 {
                n.inputs.push(step);
            }
        }
        let fail = |e: String| error(&loc, format!("optimizer: {e}"));
        // Clipping: the factor goes into each update (`dnn.adamw`'s scale), so a gradient
        // is read by its square and its update only, both wanting it reduced.
        let grads: Vec<ValueId> = pairs.iter().map(|p| p.1).collect();
        let mut scale = None;
        if self.clip > 0.0 {
            let mut total: Option<ValueId> = None;
            for &gv in &grads {
                let sq = out
                    .add1("dnn.mul", &[gv, gv], Attrs::new(), &loc)
                    .map_err(&fail)?;
                let dims: Vec<i64> = (0..g.values[gv].rank() as i64).collect();
                let s = out
                    .add1(
                        "dnn.sum",
                        &[sq],
                        attrs(&[("dims", AttrValue::Ints(dims))]),
                        &loc,
                    )
                    .map_err(&fail)?;
                total = Some(match total {
                    None => s,
                    Some(t) => out
                        .add1("dnn.add", &[t, s], Attrs::new(), &loc)
                        .map_err(&fail)?,
                });
            }
            let total = total.expect("there is a gradient");
            scale = Some(
                out.add1(
                    "dnn.clip_scale",
                    &[total],
                    attrs(&[("max_norm", AttrValue::Float(self.clip))]),
                    &loc,
                )
                .map_err(&fail)?,
            );
        }
        // The updates.
        let mut outputs = vec![loss];
        for (i, &(arg, _)) in pairs.iter().enumerate() {
            let pv = g.args[arg].value;
            let decays = match &self.no_decay {
                None => g.values[pv].rank() >= 2,
                Some(pats) => {
                    let name = g.args[arg].name().unwrap_or("");
                    !pats.iter().any(|p| glob(p, name))
                }
            };
            let decay = if decays { self.weight_decay } else { 0.0 };
            let (m, v) = states[i];
            let a = attrs(&[
                ("beta1", AttrValue::Float(self.beta1)),
                ("beta2", AttrValue::Float(self.beta2)),
                ("eps", AttrValue::Float(self.eps)),
                ("weight_decay", AttrValue::Float(decay)),
            ]);
            let mut operands = vec![pv, grads[i], m, v, lr, step];
            operands.extend(scale);
            let r = out.add("dnn.adamw", &operands, a, &loc).map_err(&fail)?;
            let p = name_of(arg);
            for (value, name) in [
                (r[0], format!("next.{p}")),
                (r[1], format!("next.adam.m.{p}")),
                (r[2], format!("next.adam.v.{p}")),
            ] {
                outputs.push(Output {
                    value,
                    attrs: attrs(&[("nns.name", AttrValue::Str(name))]),
                });
            }
        }
        out.outputs = outputs;
        Ok(Some(out))
    }
}

#[cfg(test)]
mod tests {
    use super::glob;

    #[test]
    fn name_patterns() {
        assert!(glob("*.bias", "h.0.attn.q.bias"));
        assert!(!glob("*.bias", "h.0.attn.q.weight"));
        assert!(glob("*ln_*", "h.3.ln_1.weight"));
        assert!(glob("wpe", "wpe"));
        assert!(!glob("wpe", "wpe2"));
        assert!(glob("h.*.mlp.*", "h.10.mlp.fc.weight"));
        assert!(!glob("a*b*c", "acb"));
        assert!(glob("*", ""));
    }
}

//! `--autodiff`: appends the backward graph to functions that return a scalar loss.
//!
//! The loss is the result named `loss` (or the first result). Walking the ops in reverse,
//! each op's VJP rule ([`nnscaler_dialects::vjp`]) emits explicit backward `dnn` ops; a
//! value used more than once gets the sum of its gradients. The function then also returns
//! the gradient of every `nns.param` argument, named `grad.<param name>`. Only ops between
//! the parameters and the loss are differentiated.

use crate::pipeline::{FunctionPass, PassOptions};
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::dnn;
use nnscaler_dialects::graph::{Graph, Output, ValueId};
use nnscaler_dialects::types::{AttrValue, Attrs};
use nnscaler_dialects::vjp::VjpCtx;

/// The pass.
#[derive(Debug)]
pub struct Autodiff {
    func: Option<String>,
    found: bool,
}

impl Autodiff {
    /// Reads the options (`func`).
    pub fn new(o: &PassOptions) -> Result<Self, String> {
        Ok(Autodiff {
            func: o.get("func").map(str::to_string),
            found: false,
        })
    }
}

impl FunctionPass for Autodiff {
    fn run_on_function(&mut self, g: Graph) -> Result<Option<Graph>, Diagnostics> {
        if self.func.as_deref().is_some_and(|w| w != g.name) {
            return Ok(None);
        }
        self.found = true;
        let mut d = Diagnostics::default();
        match differentiate(&g) {
            Ok(new) => Ok(Some(new)),
            Err((loc, msg)) => {
                d.error(&loc, msg);
                Err(d)
            }
        }
    }

    fn finish(&mut self) -> Result<(), Diagnostics> {
        if let (Some(w), false) = (&self.func, self.found) {
            let mut d = Diagnostics::default();
            d.error(
                &Default::default(),
                format!("autodiff: no function named @{w}"),
            );
            return Err(d);
        }
        Ok(())
    }
}

type Located = (nnscaler_dialects::diag::SrcLoc, String);

/// Returns `g` extended with its backward graph and the parameter gradients as results.
pub fn differentiate(g: &Graph) -> Result<Graph, Located> {
    let at = |msg: String| (g.loc.clone(), format!("autodiff @{}: {msg}", g.name));
    let li = g
        .outputs
        .iter()
        .position(|o| o.name() == Some("loss"))
        .unwrap_or(0);
    let Some(loss) = g.outputs.get(li).map(|o| o.value) else {
        return Err(at(
            "the function returns nothing; it must return a scalar loss".into(),
        ));
    };
    let lt = &g.values[loss];
    if !lt.shape.is_empty() || !lt.elem.is_float() {
        return Err(at(format!(
            "the loss (result {li}) must be a scalar float, not {lt}"
        )));
    }
    if g.outputs
        .iter()
        .any(|o| o.name().is_some_and(|n| n.starts_with("grad.")))
    {
        return Err(at("the function already returns gradients".into()));
    }
    let params: Vec<usize> = (0..g.args.len())
        .filter(|&i| g.args[i].is_param())
        .collect();
    if params.is_empty() {
        return Err(at(
            "the function has no nns.param arguments to differentiate".into(),
        ));
    }
    // Values that depend on a parameter (through float values).
    let mut depends = vec![false; g.values.len()];
    for &p in &params {
        depends[g.args[p].value] = true;
    }
    for n in &g.nodes {
        if n.inputs.iter().any(|&v| depends[v]) {
            for &o in &n.outputs {
                depends[o] = g.values[o].elem.is_float();
            }
        }
    }
    let mut out = g.clone();
    let nforward = g.nodes.len();
    let mut grads: Vec<Option<ValueId>> = vec![None; g.values.len()];
    let one = out
        .add1(
            "dnn.fill",
            &[],
            attrs(&[
                ("shape", AttrValue::Ints(vec![])),
                ("value", AttrValue::Float(1.0)),
            ]),
            &g.loc,
        )
        .map_err(at)?;
    grads[loss] = Some(one);
    for k in (0..nforward).rev() {
        let node = g.nodes[k].clone();
        let dys: Vec<Option<ValueId>> = node.outputs.iter().map(|&o| grads[o]).collect();
        if dys.iter().all(Option::is_none) {
            continue;
        }
        let needs: Vec<bool> = node
            .inputs
            .iter()
            .map(|&v| depends[v] && g.values[v].elem.is_float())
            .collect();
        if !needs.iter().any(|&b| b) {
            continue;
        }
        let fail = |msg: String| (node.loc.clone(), format!("autodiff: '{}': {msg}", node.op));
        let spec = dnn::spec(&node.op)
            .ok_or_else(|| fail("not a dnn op; cannot differentiate it".into()))?;
        let rule = spec.vjp().ok_or_else(|| {
            fail(match spec.grad_of {
                Some(_) => "is a backward op; second-order gradients are not supported".into(),
                None => "has no VJP rule".into(),
            })
        })?;
        let mut ctx = VjpCtx {
            g: &mut out,
            node: node.clone(),
            dys,
            needs: needs.clone(),
        };
        let dxs = rule(&mut ctx).map_err(fail)?;
        for ((&v, dx), need) in node.inputs.iter().zip(dxs).zip(needs) {
            let Some(dx) = dx else { continue };
            if !need {
                continue;
            }
            grads[v] = Some(match grads[v] {
                None => dx,
                Some(prev) => out
                    .add1("dnn.add", &[prev, dx], Attrs::new(), &node.loc)
                    .map_err(fail)?,
            });
        }
    }
    for &p in &params {
        let a = &g.args[p];
        let name = a
            .name()
            .map(str::to_string)
            .unwrap_or_else(|| format!("arg{p}"));
        let v = match grads[a.value] {
            Some(v) => v,
            None => {
                // The loss does not depend on this parameter: its gradient is zero.
                let shape = g.values[a.value].shape.clone();
                out.add1(
                    "dnn.fill",
                    &[],
                    attrs(&[
                        ("shape", AttrValue::Ints(shape)),
                        ("value", AttrValue::Float(0.0)),
                    ]),
                    &g.loc,
                )
                .map_err(at)?
            }
        };
        out.outputs.push(Output {
            value: v,
            attrs: attrs(&[("nns.name", AttrValue::Str(format!("grad.{name}")))]),
        });
    }
    Ok(out)
}

fn attrs(a: &[(&str, AttrValue)]) -> Attrs {
    a.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

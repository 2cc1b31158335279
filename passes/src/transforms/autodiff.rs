//! `--autodiff`: appends the backward graph to functions that return a scalar loss.
//!
//! The loss is the result named `loss` (or the first result). Walking the ops in reverse,
//! each op's VJP rule ([`nnscaler_dialects::vjp`]) emits explicit backward `dnn` ops; a
//! value used more than once gets the sum of its gradients. The function then also returns
//! the gradient of every `nns.param` argument, named `grad.<param name>`. Only ops between
//! the parameters and the loss are differentiated.

use crate::pass::{ModulePass, PassOptions};
use crate::rewrite::rewrite_funcs;
use melior::ir::OperationRef;
use nnscaler_dialects::diag::{Diagnostics, SrcLoc};
use nnscaler_dialects::dnn;
use nnscaler_dialects::graph::{Graph, Output, ValueId};
use nnscaler_dialects::types::{AttrValue, Attrs};
use nnscaler_dialects::userop::UserOp;
use nnscaler_dialects::view::{top_level_ops, FuncView};
use nnscaler_dialects::vjp::VjpCtx;

/// The pass.
#[derive(Debug)]
pub struct Autodiff {
    func: Option<String>,
}

impl Autodiff {
    /// Reads the options (`func`).
    pub fn new(o: &PassOptions) -> Result<Self, String> {
        Ok(Autodiff {
            func: o.get("func").map(str::to_string),
        })
    }
}

impl ModulePass for Autodiff {
    fn run(&mut self, module: &OperationRef<'_, '_>) -> Result<(), Diagnostics> {
        let mut found = false;
        let mut derive: Vec<String> = Vec::new();
        let want = self.func.clone();
        rewrite_funcs(module, &mut |g| {
            if want.as_deref().is_some_and(|w| w != g.name) {
                return Ok(None);
            }
            found = true;
            differentiate_with(&g, &mut derive)
                .map(Some)
                .map_err(|(loc, msg)| located(&loc, msg))
        })?;
        if let (Some(w), false) = (&self.func, found) {
            return Err(located(
                &Default::default(),
                format!("autodiff: no function named @{w}"),
            ));
        }
        // The VJP functions of user ops without `nns.vjp`, derived from their bodies (which
        // may call further user ops).
        let mut done = 0;
        while done < derive.len() {
            let name = derive[done].clone();
            done += 1;
            add_vjp_function(module, &name, &mut derive)?;
        }
        Ok(())
    }
}

fn located(loc: &SrcLoc, msg: impl Into<String>) -> Diagnostics {
    let mut d = Diagnostics::default();
    d.error(loc, msg);
    d
}

type Located = (SrcLoc, String);

/// The name of the derived VJP function of user op `f`.
pub fn vjp_name(f: &str) -> String {
    format!("{f}.vjp")
}

/// Returns `g` extended with its backward graph and the parameter gradients as results.
/// Calls of user ops are differentiated through their VJP function: the callee's
/// `nns.vjp`, else `@<callee>.vjp`, whose derivation is then needed ([`vjp_function`]);
/// the names of those callees are added to `derive`.
pub fn differentiate_with(g: &Graph, derive: &mut Vec<String>) -> Result<Graph, Located> {
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
    let mut out = g.clone();
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
    let wrt: Vec<ValueId> = params.iter().map(|&p| g.args[p].value).collect();
    let grads = backprop(g, &mut out, &[(loss, one)], &wrt, derive)?;
    for &p in &params {
        let a = &g.args[p];
        let name = a
            .name()
            .map(str::to_string)
            .unwrap_or_else(|| format!("arg{p}"));
        let v = match grads[a.value] {
            Some(v) => v,
            // The loss does not depend on this parameter: its gradient is zero.
            None => zeros(&mut out, a.value, &g.loc).map_err(at)?,
        };
        out.outputs.push(Output {
            value: v,
            attrs: attrs(&[("nns.name", AttrValue::Str(format!("grad.{name}")))]),
        });
    }
    // A placed forward (--place staged every op) gets its new ops staged too; a user's
    // `nns.stage` pin on some ops of an unplaced forward stays a pin for --place.
    let placed = g
        .nodes
        .iter()
        .filter(|n| n.op != "func.return")
        .all(|n| n.attrs.contains_key("nns.stage"));
    if placed {
        let all = vec![true; out.nodes.len()];
        crate::transforms::place::complete_stages(&mut out, &all);
    }
    Ok(out)
}

/// Returns `g` extended with its backward graph (see [`differentiate_with`]); the graph
/// must not call user ops without `nns.vjp`.
pub fn differentiate(g: &Graph) -> Result<Graph, Located> {
    let mut derive = Vec::new();
    let out = differentiate_with(g, &mut derive)?;
    match derive.first() {
        None => Ok(out),
        Some(f) => Err((
            g.loc.clone(),
            format!(
                "autodiff @{}: @{f} needs a derived VJP function; run it through the autodiff pass",
                g.name
            ),
        )),
    }
}

/// A zero tensor shaped like value `v` of `out`.
fn zeros(out: &mut Graph, v: ValueId, loc: &SrcLoc) -> Result<ValueId, String> {
    let shape = out.values[v].shape.clone();
    out.add1(
        "dnn.fill",
        &[],
        attrs(&[
            ("shape", AttrValue::Ints(shape)),
            ("value", AttrValue::Float(0.0)),
        ]),
        loc,
    )
}

/// The reverse sweep over the nodes of `g` (appending backward ops to `out`, a copy of `g`
/// or of a graph extending it): `seeds` give the gradients of some values, and the
/// gradients of the values `wrt` depend on are returned (by value id, `None` where there
/// is no path).
fn backprop(
    g: &Graph,
    out: &mut Graph,
    seeds: &[(ValueId, ValueId)],
    wrt: &[ValueId],
    derive: &mut Vec<String>,
) -> Result<Vec<Option<ValueId>>, Located> {
    // Values that depend on one of `wrt` (through float values).
    let mut depends = vec![false; g.values.len()];
    for &v in wrt {
        depends[v] = true;
    }
    for n in &g.nodes {
        if n.inputs.iter().any(|&v| depends[v]) {
            for &o in &n.outputs {
                depends[o] = g.values[o].elem.is_float();
            }
        }
    }
    let mut grads: Vec<Option<ValueId>> = vec![None; g.values.len()];
    for &(v, dv) in seeds {
        grads[v] = Some(dv);
    }
    for k in (0..g.nodes.len()).rev() {
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
        // Backward ops run on their forward op's pipeline stage.
        let first_new = out.nodes.len();
        let dxs: Vec<Option<ValueId>> = if let Some(u) = g.user_ops.of_call(&node.op, &node.attrs) {
            call_vjp(out, &node, u, &dys, derive).map_err(fail)?
        } else {
            let spec = dnn::spec(&node.op)
                .ok_or_else(|| fail("not a dnn op or a user op; cannot differentiate it".into()))?;
            let rule = nnscaler_dialects::dnn::vjp_rule(spec.name).ok_or_else(|| {
                fail(match spec.grad_of {
                    Some(_) => "is a backward op; second-order gradients are not supported".into(),
                    None => "has no VJP rule".into(),
                })
            })?;
            let mut ctx = VjpCtx {
                g: out,
                node: (&node).into(),
                dys,
                needs: needs.clone(),
            };
            rule(&mut ctx).map_err(fail)?
        };
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
        if let Some(stage) = node.attrs.get("nns.stage") {
            for n in &mut out.nodes[first_new..] {
                n.attrs.insert("nns.stage".into(), stage.clone());
            }
        }
    }
    Ok(grads)
}

/// The backward of a call of user op `u`: a call of its VJP function on the operands and
/// the results' gradients (zeros where a result has none), one gradient per operand.
fn call_vjp(
    out: &mut Graph,
    node: &nnscaler_dialects::graph::Node,
    u: &UserOp,
    dys: &[Option<ValueId>],
    derive: &mut Vec<String>,
) -> Result<Vec<Option<ValueId>>, String> {
    let callee = match &u.vjp {
        Some(v) => v.clone(),
        None if !u.has_body => {
            return Err(format!(
                "@{} is a kernel without a body: give it 'nns.vjp = @...' to differentiate it",
                u.name
            ))
        }
        None => {
            if !derive.contains(&u.name) {
                derive.push(u.name.clone());
            }
            vjp_name(&u.name)
        }
    };
    let mut inputs = node.inputs.clone();
    for (j, dy) in dys.iter().enumerate() {
        inputs.push(match dy {
            Some(d) => *d,
            None => zeros(out, node.outputs[j], &node.loc)?,
        });
    }
    let types = node.inputs.iter().map(|&v| out.values[v].clone()).collect();
    let mut a = Attrs::new();
    a.insert("callee".into(), AttrValue::Other(format!("@{callee}")));
    let dxs = out.add_raw("func.call", &inputs, types, a, &node.loc);
    Ok(dxs.into_iter().map(Some).collect())
}

/// Turns `f`, the graph of user op `u`'s function, into its VJP function: the operands,
/// then one gradient per result, in; one gradient per operand out; annotated with
/// [`nnscaler_dialects::annotation::Annotation::vjp`]. The body recomputes the forward
/// ops it needs. Calls of further user ops inside add their names to `derive`.
pub fn vjp_function(mut f: Graph, u: &UserOp, derive: &mut Vec<String>) -> Result<Graph, Located> {
    let at = |msg: String| (u.loc.clone(), format!("autodiff: @{}: {msg}", u.name));
    let anno = u.annotation.vjp().map_err(|e| {
        at(format!(
            "cannot derive the VJP's annotation ({e}); give 'nns.vjp'"
        ))
    })?;
    if let Some(i) = f
        .args
        .iter()
        .position(|a| !f.values[a.value].elem.is_float())
    {
        return Err(at(format!(
            "operand {i} is not a float tensor; a derived VJP returns a gradient per operand, so give 'nns.vjp'"
        )));
    }
    let fwd = f.clone();
    let mut seeds = Vec::new();
    for o in &fwd.outputs {
        let dy = f.add_arg(f.values[o.value].clone(), Attrs::new());
        seeds.push((o.value, dy));
    }
    let wrt: Vec<ValueId> = fwd.args.iter().map(|a| a.value).collect();
    let grads = backprop(&fwd, &mut f, &seeds, &wrt, derive)?;
    let mut outputs = Vec::new();
    for &v in &wrt {
        let g = match grads[v] {
            Some(g) => g,
            None => zeros(&mut f, v, &u.loc).map_err(at)?,
        };
        outputs.push(Output {
            value: g,
            attrs: Attrs::new(),
        });
    }
    f.outputs = outputs;
    f.name = vjp_name(&u.name);
    f.func_attrs.remove("nns.vjp");
    f.func_attrs
        .insert("nns.annotation".into(), AttrValue::Str(anno.to_string()));
    Ok(f)
}

/// Adds user op `name`'s derived VJP function to `module`, right after it, unless the
/// module has it already.
fn add_vjp_function(
    module: &OperationRef<'_, '_>,
    name: &str,
    derive: &mut Vec<String>,
) -> Result<(), Diagnostics> {
    let target = vjp_name(name);
    let mut callee = None;
    let mut exists = false;
    top_level_ops(module, &mut |op| match FuncView::of(op) {
        Some(f) if f.name == name => callee = Some(op.to_raw()),
        Some(f) if f.name == target => exists = true,
        _ => {}
    });
    if exists {
        return Ok(());
    }
    let callee = callee.ok_or_else(|| {
        located(
            &Default::default(),
            format!("autodiff: no function @{name}"),
        )
    })?;
    // SAFETY: `callee` is a live top-level op of `module`; the copy is made in its context
    // and handed to the module's body right after it.
    let copy = unsafe {
        use nnscaler_dialects::rewriter::{set_attr, Builder};
        let copy = mlir_sys::mlirOperationClone(callee);
        let b = Builder::for_op(copy);
        let sym = b
            .attribute(&AttrValue::Str(target.clone()))
            .map_err(|e| located(&Default::default(), e))?;
        set_attr(copy, "sym_name", sym);
        let block = mlir_sys::mlirOperationGetBlock(callee);
        mlir_sys::mlirBlockInsertOwnedOperationAfter(block, callee, copy);
        OperationRef::from_raw(copy)
    };
    let f = Graph::from_func(&copy).map_err(|e| located(&e.loc, e.message))?;
    let u = f
        .user_ops
        .0
        .get(name)
        .cloned()
        .ok_or_else(|| located(&f.loc, format!("autodiff: @{name} is not a user op")))?;
    let g = vjp_function(f, &u, derive).map_err(|(loc, m)| located(&loc, m))?;
    g.write_back().map_err(|e| located(&g.loc, e))
}

fn attrs(a: &[(&str, AttrValue)]) -> Attrs {
    a.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

//! `--recompute{policy=full|selective}`: trades compute for activation memory. Forward ops
//! chosen by the policy are cloned into the backward, right before the first backward op
//! that reads one of their layer's results, and the backward reads the clones; the forward
//! values they replace no longer live from the forward to the backward (in a pipeline: are
//! no longer results of a stage's forward fragment kept until its backward). Only what
//! the backward reads runs again: the chosen ops whose results a backward op on their
//! stage reads, and the chosen ops of their layer those read (a layer's output that only
//! the next stage's backward reads, as the value sent to it, is not recomputed).
//!
//! Layers: an op's `nns.layer = "name"` when written; else the layer its parameters name
//! (a parameter `h.3.attn.q.weight` or `layers.3.mlp.w1` is in layer `h.3` / `layers.3`:
//! the name up to its first numeric component); an op without parameters belongs to the
//! layer of the forward op before it, and an op whose parameters name no layer (a final
//! norm, an embedding) to none.
//!
//! * `full` recomputes every forward op of each layer: only a layer's inputs (and what
//!   is outside any layer) are kept for the backward, and the layer's forward runs again
//!   inside its backward.
//! * `selective` recomputes each layer's ops other than its matrix products (`linear`,
//!   `matmul`): the attention core (head reshapes and transposes, rotary, attention),
//!   norms and activations, Megatron's selective recomputation; the matrix products'
//!   outputs are kept.
//!
//! A layer split by a pipeline stage boundary is recomputed per stage: each part from
//! what reaches it (the later part from the values the earlier stage sent).
//!
//! The clones carry `nns.recompute` and everything the original had (stage, directives),
//! so later passes treat them as backward ops of the original's stage. The values
//! computed are the same (the kernels are deterministic; dropout masks depend only on the
//! element's position), so the step's results do not change.

use crate::layouts::error;
use crate::pass::{FunctionPass, PassOptions};
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::{Graph, ValueId};
use nnscaler_dialects::types::AttrValue;
use std::collections::{BTreeMap, HashMap};

/// What to recompute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Every forward op of each layer.
    Full,
    /// Each layer's ops other than its matrix products.
    Selective,
}

impl Policy {
    /// `full` or `selective`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "full" => Ok(Policy::Full),
            "selective" => Ok(Policy::Selective),
            other => Err(format!(
                "recompute: unknown policy '{other}' (policies: full, selective)"
            )),
        }
    }
}

/// The pass.
#[derive(Debug)]
pub struct Recompute {
    policy: Policy,
    remarks: Diagnostics,
}

impl Recompute {
    /// Options: `policy` (also written alone: `--recompute=full`).
    pub fn new(o: &PassOptions) -> Result<Self, String> {
        let policy = Policy::parse(o.get("policy").unwrap_or("full"))?;
        Ok(Recompute {
            policy,
            remarks: Diagnostics::default(),
        })
    }
}

impl FunctionPass for Recompute {
    fn run_on_function(&mut self, g: Graph) -> Result<Option<Graph>, Diagnostics> {
        if g.is_localized() {
            return Err(error(
                &g.loc,
                "recompute: the function is localized; recompute before --localize",
            ));
        }
        if !has_backward(&g) {
            return Err(error(
                &g.loc,
                format!(
                    "recompute: @{} has no backward to recompute in; run --autodiff first",
                    g.name
                ),
            ));
        }
        let (out, n) = recompute(&g, self.policy);
        self.remarks.remark(
            &g.loc,
            format!(
                "recompute @{}: {n} forward ops recomputed in the backward ({})",
                g.name,
                match self.policy {
                    Policy::Full => "full",
                    Policy::Selective => "selective",
                }
            ),
        );
        Ok(Some(out))
    }
    fn take_remarks(&mut self) -> Diagnostics {
        std::mem::take(&mut self.remarks)
    }
}

/// Whether `g` is a training step: it returns gradients (`grad.` results), or it updates
/// parameters with them (`--optimizer`'s state arguments).
pub fn has_backward(g: &Graph) -> bool {
    g.outputs
        .iter()
        .any(|o| o.name().is_some_and(|n| n.starts_with("grad.")))
        || g.args.iter().any(|a| a.attrs.contains_key("nns.state_of"))
}

/// Which ops compute the loss (the first result not named `grad.*`): the forward.
pub fn forward_ops(g: &Graph) -> Vec<bool> {
    let producer = g.producers();
    let mut fwd = vec![false; g.nodes.len()];
    let Some(loss) = g
        .outputs
        .iter()
        .find(|o| !o.name().is_some_and(|n| n.starts_with("grad.")))
    else {
        return fwd;
    };
    let mut seen = vec![false; g.values.len()];
    let mut stack = vec![loss.value];
    while let Some(v) = stack.pop() {
        if std::mem::replace(&mut seen[v], true) {
            continue;
        }
        if let Some(p) = producer[v] {
            fwd[p] = true;
            stack.extend(&g.nodes[p].inputs);
        }
    }
    fwd
}

/// The layer a parameter name places its op in: the name up to its first numeric
/// component (`h.3.attn.q.weight` → `h.3`).
pub(crate) fn layer_of_param(name: &str) -> Option<String> {
    let parts: Vec<&str> = name.split('.').collect();
    let i = (1..parts.len()).find(|&i| parts[i].parse::<u64>().is_ok())?;
    Some(parts[..=i].join("."))
}

/// The layer of each forward op (see the module docs); `None` outside any layer.
pub fn layers(g: &Graph, fwd: &[bool]) -> Vec<Option<String>> {
    let param_name: HashMap<ValueId, &str> = g
        .args
        .iter()
        .filter(|a| a.is_param())
        .filter_map(|a| a.name().map(|n| (a.value, n)))
        .collect();
    let mut out = vec![None; g.nodes.len()];
    let mut current: Option<String> = None;
    for (k, n) in g.nodes.iter().enumerate() {
        if !fwd[k] {
            continue;
        }
        let own = match n.attrs.get("nns.layer") {
            Some(AttrValue::Str(l)) => Some(Some(l.clone())),
            _ => {
                let names: Vec<&str> = n
                    .inputs
                    .iter()
                    .filter_map(|v| param_name.get(v).copied())
                    .collect();
                if names.is_empty() {
                    None
                } else {
                    Some(names.iter().find_map(|p| layer_of_param(p)))
                }
            }
        };
        if let Some(l) = own {
            current = l;
        }
        out[k] = current.clone();
    }
    out
}

/// Whether `policy` recomputes forward op `op`.
fn chosen(policy: Policy, op: &str) -> bool {
    match policy {
        Policy::Full => true,
        Policy::Selective => !matches!(op, "dnn.linear" | "dnn.matmul"),
    }
}

/// `g` with the policy's forward ops recomputed in the backward, and how many were.
pub fn recompute(g: &Graph, policy: Policy) -> (Graph, usize) {
    let fwd = forward_ops(g);
    let layer = layers(g, &fwd);
    // The recomputed ops of each layer, and where each value comes from.
    // A group is a layer's part on one pipeline stage: a layer cut by a stage boundary is
    // recomputed in two parts, the later one reading what the earlier stage sent forward
    // (recomputing across the boundary would make each stage's backward wait for the
    // other's).
    let mut group: Vec<Option<usize>> = vec![None; g.nodes.len()];
    let mut names: BTreeMap<(String, Option<i64>), usize> = BTreeMap::new();
    for k in 0..g.nodes.len() {
        if let (true, Some(l)) = (fwd[k], &layer[k]) {
            if chosen(policy, &g.nodes[k].op) && !g.nodes[k].attrs.contains_key("nns.recompute") {
                let stage = match g.nodes[k].attrs.get("nns.stage") {
                    Some(AttrValue::Int(s)) => Some(*s),
                    _ => None,
                };
                let next = names.len();
                group[k] = Some(*names.entry((l.clone(), stage)).or_insert(next));
            }
        }
    }
    let producer = g.producers();
    let members: Vec<Vec<usize>> = {
        let mut m = vec![Vec::new(); names.len()];
        for (k, gr) in group.iter().enumerate() {
            if let Some(i) = gr {
                m[*i].push(k);
            }
        }
        m
    };
    let stage_of = |k: usize| match g.nodes[k].attrs.get("nns.stage") {
        Some(AttrValue::Int(s)) => Some(*s),
        _ => None,
    };
    // A backward op reads the clones of a group on its own stage only; one on another
    // stage reads what crossed the boundary in the forward.
    let same_stage = |k: usize, v: ValueId| -> Option<usize> {
        let p = producer[v]?;
        let i = group[p]?;
        (stage_of(p.index()) == stage_of(k)).then_some(i)
    };
    // The members run again: those whose results a backward op on their stage reads, and
    // the members of their group they read (producers come first: one sweep back).
    let mut needed = vec![false; g.nodes.len()];
    for (k, n) in g.nodes.iter().enumerate() {
        if !fwd[k] {
            for &v in &n.inputs {
                if same_stage(k, v).is_some() {
                    needed[producer[v].expect("a group's value has a producer").index()] = true;
                }
            }
        }
    }
    for m in (0..g.nodes.len()).rev() {
        if needed[m] {
            for &v in &g.nodes[m].inputs {
                if let Some(p) = producer[v].filter(|p| group[*p] == group[m]) {
                    needed[p.index()] = true;
                }
            }
        }
    }
    let mut out = g.clone();
    let old = std::mem::take(&mut out.nodes);
    let mut clone_of: HashMap<ValueId, ValueId> = HashMap::new();
    let mut done = vec![false; members.len()];
    let mut count = 0;
    for (k, mut n) in old.into_iter().enumerate() {
        if !fwd[k] {
            // A backward op: make the clones of every group it reads first.
            let needs: Vec<usize> = n.inputs.iter().filter_map(|&v| same_stage(k, v)).collect();
            for i in needs {
                if std::mem::replace(&mut done[i], true) {
                    continue;
                }
                for &m in members[i].iter().filter(|&&m| needed[m]) {
                    let orig = &g.nodes[m];
                    // Within the group, the clones; from outside it (the layer's inputs,
                    // parameters), the values the forward kept.
                    let inputs: Vec<ValueId> = orig
                        .inputs
                        .iter()
                        .map(|&v| match producer[v].and_then(|p| group[p]) {
                            Some(j) if j == i => clone_of[&v],
                            _ => v,
                        })
                        .collect();
                    let types = orig.outputs.iter().map(|&o| g.values[o].clone()).collect();
                    let mut attrs = orig.attrs.clone();
                    attrs.insert("nns.recompute".into(), AttrValue::Unit);
                    let outs = out.add_raw(&orig.op, &inputs, types, attrs, &orig.loc);
                    for (&o, &c) in orig.outputs.iter().zip(&outs) {
                        clone_of.insert(o, c);
                    }
                    count += 1;
                }
            }
            for v in &mut n.inputs {
                if same_stage(k, *v).is_some() {
                    *v = clone_of[v];
                }
            }
        }
        out.nodes.push(n);
    }
    (out, count)
}

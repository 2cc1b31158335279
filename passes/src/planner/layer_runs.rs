//! Profiles of one block per run of identical layers: the plan search compiles a model
//! whose runs of four or more identical consecutive layers (same ops, attributes, shapes
//! and wiring on their own parameters: `split_search::blocks`) are cut to their first,
//! second and last layers, and expands each profile back, the second layer standing for
//! every middle layer of its run. A 96-layer model is profiled as a 3-layer one, so a
//! profile costs what a small model's does; the items are those of the whole model
//! (tested equal in `tools/tests/integration/plan_search.rs`): a middle layer reads what the layer
//! before it made and feeds the next, whichever they are, and its ops compile alike.

use crate::planner::split_search::blocks;
use crate::transforms::recompute::{has_backward, layers};
use nnscaler_dialects::graph::{Graph, ValueId};
use std::collections::HashMap;

/// A run of identical layers cut to its first, second and last.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    /// Its second layer, kept to stand for the middle ones.
    pub second: String,
    /// The layers of the whole model the second stands for, in order (itself first).
    pub names: Vec<String>,
}

/// A forward with its runs of identical layers cut.
#[derive(Clone, Debug)]
pub struct Reduced {
    /// The cut forward.
    pub forward: Graph,
    /// The runs cut.
    pub runs: Vec<Run>,
}

/// `g` (a forward) with each run of four or more identical consecutive layers cut to its
/// first, second and last; `None` when nothing is cut or `g` does not lend itself: a
/// training step, a layer whose ops are not consecutive, a value of a cut layer read by
/// a kept op other than the last layer's reading what the layer before it made, calls of
/// user ops.
pub fn reduce(g: &Graph) -> Option<Reduced> {
    if has_backward(g) || !g.user_ops.is_empty() {
        return None;
    }
    let all = vec![true; g.nodes.len()];
    let layer = layers(g, &all);
    let blocks = blocks(g, &all, &layer);
    // Each layer's ops consecutive; runs of identical layers back to back.
    if blocks
        .iter()
        .any(|b| b.ops.windows(2).any(|w| w[1] != w[0] + 1))
    {
        return None;
    }
    let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        let joins = runs.last().is_some_and(|r| {
            let prev = &blocks[r.end - 1];
            r.end == i && prev.same(b) && prev.ops.last().map(|&k| k + 1) == b.ops.first().copied()
        });
        if joins {
            runs.last_mut().expect("checked").end = i + 1;
        } else {
            runs.push(i..i + 1);
        }
    }
    runs.retain(|r| r.len() >= 4);
    if runs.is_empty() {
        return None;
    }
    let mut dropped = vec![false; g.nodes.len()];
    let mut map: HashMap<ValueId, ValueId> = HashMap::new();
    let mut kept_runs = Vec::new();
    for r in &runs {
        let (second, before_last) = (&blocks[r.start + 1], &blocks[r.end - 2]);
        for b in &blocks[r.start + 2..r.end - 1] {
            for &k in &b.ops {
                dropped[k] = true;
            }
        }
        // The last layer reads what the one before it made: the kept second layer's
        // values at the same places.
        for (&from, &to) in before_last.ops.iter().zip(&second.ops) {
            for (&v, &w) in g.nodes[from].outputs.iter().zip(&g.nodes[to].outputs) {
                map.insert(v, w);
            }
        }
        kept_runs.push(Run {
            second: second.name.clone(),
            names: blocks[r.start + 1..r.end - 1]
                .iter()
                .map(|b| b.name.clone())
                .collect(),
        });
    }
    // Only the last layer's values may be read after the run.
    let mut made_by_dropped = vec![false; g.values.len()];
    for (k, n) in g.nodes.iter().enumerate() {
        if dropped[k] {
            for &o in &n.outputs {
                made_by_dropped[o] = true;
            }
        }
    }
    let remap = |v: ValueId| map.get(&v).copied().unwrap_or(v);
    let mut out = g.clone();
    out.nodes = Vec::new();
    for (k, n) in g.nodes.iter().enumerate() {
        if dropped[k] {
            continue;
        }
        let mut n = n.clone();
        for v in &mut n.inputs {
            if made_by_dropped[*v] && !map.contains_key(v) {
                return None;
            }
            *v = remap(*v);
        }
        n.origin = None;
        out.nodes.push(n);
    }
    for o in &mut out.outputs {
        if made_by_dropped[o.value] && !map.contains_key(&o.value) {
            return None;
        }
        o.value = remap(o.value);
    }
    // The cut layers' parameters go with them.
    let mut used = vec![false; g.values.len()];
    for n in &out.nodes {
        for &v in &n.inputs {
            used[v] = true;
        }
    }
    for o in &out.outputs {
        used[o.value] = true;
    }
    out.args.retain(|a| used[a.value] || !a.is_param());
    out.source = None;
    Some(Reduced {
        forward: out,
        runs: kept_runs,
    })
}

/// The forward of training step `g`: the ops its loss depends on
/// ([`crate::transforms::recompute::forward_ops`]), the loss as its one result, and the parameters
/// and the data arguments those ops read (optimizer state and the step's scalars
/// dropped); `None` when `g` has no backward.
pub fn forward_of_step(g: &Graph) -> Option<Graph> {
    if !has_backward(g) {
        return None;
    }
    let fwd = crate::transforms::recompute::forward_ops(g);
    let loss = g
        .outputs
        .iter()
        .find(|o| !o.name().is_some_and(|n| n.starts_with("grad.")))?
        .clone();
    let mut f = g.clone();
    f.nodes = g
        .nodes
        .iter()
        .zip(&fwd)
        .filter(|(_, &keep)| keep)
        .map(|(n, _)| {
            let mut n = n.clone();
            n.attrs.remove("nns.stage");
            n
        })
        .collect();
    let read: std::collections::HashSet<ValueId> = f
        .nodes
        .iter()
        .flat_map(|n| n.inputs.iter().copied())
        .collect();
    f.args.retain(|a| {
        !a.attrs.contains_key("nns.state_of") && (a.is_param() || read.contains(&a.value))
    });
    f.outputs = vec![loss];
    f.func_attrs.remove("nns.schedule");
    Some(f)
}

/// Training step `g` with its runs of identical layers cut, for profiling in its stead
/// (what `nnscaler plan` profiles for a forward): its forward ([`forward_of_step`])
/// [`reduce`]d, then `--autodiff` and, when `g` updates its parameters, `--optimizer`
/// (with `g`'s clipping: its ops cost time; the other options only change constants).
/// `None` when nothing is cut or the cut step cannot be made.
pub fn cut_step(g: &Graph, lookup: crate::pass::Lookup) -> Option<Cut> {
    let forward = forward_of_step(g)?;
    let r = reduce(&forward)?;
    let optimizer = if g.args.iter().any(|a| a.attrs.contains_key("nns.state_of")) {
        let clip = g.nodes.iter().find_map(|n| match n.attrs.get("max_norm") {
            Some(nnscaler_dialects::types::AttrValue::Float(c)) if n.op == "dnn.clip_scale" => {
                Some(*c)
            }
            _ => None,
        });
        Some(clip.map(|c| format!("clip={c}")).unwrap_or_default())
    } else {
        None
    };
    let step = training_step_of(&r.forward, None, optimizer.as_deref(), lookup).ok()?;
    Some(Cut { step, runs: r.runs })
}

/// Forward `forward` made a training step by the passes on the graph itself (no MLIR):
/// `--autocast` with options `autocast` if given, `--autodiff`, and `--optimizer` with
/// options `optimizer` if given; each pass's result is compacted as writing it to MLIR and
/// reading it back would leave it. A forward that calls functions is refused: a call needs
/// its callee's declaration (and perhaps a derived VJP function), which a function alone
/// does not carry.
pub fn training_step_of(
    forward: &Graph,
    autocast: Option<&str>,
    optimizer: Option<&str>,
    lookup: crate::pass::Lookup,
) -> Result<Graph, String> {
    use crate::pass::FunctionPass;
    use crate::rewrite::compact;
    if let Some(n) = forward.nodes.iter().find(|n| n.op == "func.call") {
        return Err(format!(
            "{}: a call ('{}') in a step made without its module",
            n.loc, n.op
        ));
    }
    let options = |name: &str, text: &str| {
        crate::pipeline::Step::named(lookup, name, text).map(|s| s.options)
    };
    // A pass's result, or its input where it changed nothing.
    let run = |pass: &mut dyn FunctionPass, g: Graph| -> Result<Graph, String> {
        let before = g.clone();
        match pass.run_on_function(g).map_err(|d| d.to_string())? {
            Some(new) => Ok(compact(new)),
            None => Ok(before),
        }
    };
    let mut g = forward.clone();
    if let Some(text) = autocast {
        let mut pass = crate::transforms::autocast::Autocast::new(&options("autocast", text)?)?;
        g = run(&mut pass, g)?;
    }
    let mut derive = Vec::new();
    g = compact(
        crate::transforms::autodiff::differentiate_with(&g, &mut derive)
            .map_err(|(loc, msg)| format!("{loc}: {msg}"))?,
    );
    if !derive.is_empty() {
        return Err(format!(
            "@{}: user ops whose VJP must be derived: {}",
            g.name,
            derive.join(", ")
        ));
    }
    if let Some(text) = optimizer {
        let mut pass = crate::transforms::optimizer::Optimizer::new(&options("optimizer", text)?)?;
        g = run(&mut pass, g)?;
    }
    Ok(g)
}

/// A training step made from a forward whose runs of identical layers are cut
/// (this module's runs), to profile in the whole step's stead.
#[derive(Clone, Debug)]
pub struct Cut {
    /// The cut step.
    pub step: Graph,
    /// The runs cut.
    pub runs: Vec<Run>,
}

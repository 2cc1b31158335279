//! The named parallelization policies' directives: [`Policy`] and [`plan`], which writes a
//! policy's data, sequence, tensor (Megatron) and micro-batch layouts into a training step
//! (what `--plan=<policy>` does, [`crate::transforms::plan`]; the plan search and the split search
//! start from them).

use crate::layouts::error;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::{Graph, ValueId};
use nnscaler_dialects::nns::{AxisLayout, Layout, Mesh};
use nnscaler_dialects::types::AttrValue;

/// A named policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Data parallel.
    Dp,
    /// Megatron tensor parallel.
    Megatron,
    /// Both.
    DpMegatron,
    /// Megatron with sequence parallelism.
    MegatronSp,
    /// Data parallel and Megatron with sequence parallelism.
    DpMegatronSp,
    /// Data parallel over `dp`; every op's split over `tp` searched (`split_search.rs`).
    TpSearch,
}

impl Policy {
    /// The policy named `s` (the `--plan` option).
    pub(crate) fn parse(s: &str) -> Result<Self, String> {
        match s {
            "dp" => Ok(Policy::Dp),
            "megatron" => Ok(Policy::Megatron),
            "dp-megatron" => Ok(Policy::DpMegatron),
            "megatron-sp" => Ok(Policy::MegatronSp),
            "dp-megatron-sp" => Ok(Policy::DpMegatronSp),
            "tp-search" => Ok(Policy::TpSearch),
            other => Err(format!(
                "unknown policy '{other}' (policies: dp, megatron, dp-megatron, megatron-sp, dp-megatron-sp, tp-search, auto)"
            )),
        }
    }

    /// The mesh axes the policy splits over.
    pub(crate) fn axes(self) -> &'static [&'static str] {
        match self {
            Policy::Dp => &["dp"],
            Policy::Megatron => &["tp"],
            Policy::DpMegatron | Policy::DpMegatronSp | Policy::TpSearch => &["dp", "tp"],
            Policy::MegatronSp => &["tp"],
        }
    }
}

pub(crate) fn policy_name(p: Policy) -> &'static str {
    match p {
        Policy::Dp => "dp",
        Policy::Megatron => "megatron",
        Policy::DpMegatron => "dp-megatron",
        Policy::MegatronSp => "megatron-sp",
        Policy::DpMegatronSp => "dp-megatron-sp",
        Policy::TpSearch => "tp-search",
    }
}

pub(crate) fn set_layout(g: &mut Graph, arg: usize, mesh: &Mesh, axes: Vec<(String, AxisLayout)>) {
    let l = Layout {
        mesh: mesh.name.clone(),
        axes,
    };
    g.args[arg].attrs.insert(
        "nns.layout".into(),
        AttrValue::Layout(std::sync::Arc::new(l)),
    );
}

/// Writes the policy's directives into `g` (`tp-search` needs a cluster: see
/// [`crate::planner::split_search::tp_search`]; here it plans `dp` only).
pub fn plan(mut g: Graph, policy: Policy, mesh: &Mesh) -> Result<Graph, Diagnostics> {
    // Layouts the user wrote stay; the policy composes the rest (dp, then the sequence
    // over tp, then the micro-batches).
    let given: Vec<bool> = g
        .args
        .iter()
        .map(|a| a.attrs.contains_key("nns.layout"))
        .collect();
    if matches!(
        policy,
        Policy::Dp | Policy::DpMegatron | Policy::DpMegatronSp | Policy::TpSearch
    ) {
        let n = mesh.axis("dp").unwrap_or(1);
        for i in 0..g.args.len() {
            let a = &g.args[i];
            let ty = &g.values[a.value];
            if a.is_param()
                || a.attrs.contains_key("nns.state_of")
                || ty.shape.is_empty()
                || a.attrs.contains_key("nns.layout")
            {
                continue;
            }
            dim_divides(
                &g,
                i,
                (0, "batch"),
                ("dp", n),
                "; give the model a batch dp divides (nnscaler import --batch N)",
            )?;
            set_layout(&mut g, i, mesh, vec![("dp".into(), AxisLayout::D(0))]);
        }
    }
    if let Some(n) = mesh.axis("sp") {
        // Context parallelism: data inputs [batch, seq, ...] are cut on their positions
        // (dim 1) over `sp` too (inside dp's batch cut, outside Megatron-SP's over tp).
        // Propagation keeps every per-token op on the shard; an attention's queries stay
        // split, its keys and values are gathered, and their gradients reduce-scattered
        // back; parameters' gradients are partial over `sp`, as over `dp`.
        split_positions(&mut g, mesh, &given, "sp", n)?;
    }
    if matches!(
        policy,
        Policy::Megatron | Policy::DpMegatron | Policy::MegatronSp | Policy::DpMegatronSp
    ) {
        megatron(&mut g, mesh);
    }
    check_param_layouts(&g, policy, mesh)?;
    state_layouts(&mut g);
    if matches!(policy, Policy::MegatronSp | Policy::DpMegatronSp) {
        // The residual stream is split on the sequence: data inputs [batch, seq, ...] cut
        // on dim 1. Propagation then keeps norms and residual adds sequence-split; a
        // row-parallel result meets the split stream through a reduce_scatter, and a
        // column-parallel linear gathers its input with an all_gather.
        let n = mesh.axis("tp").unwrap_or(1);
        split_positions(&mut g, mesh, &given, "tp", n)?;
    }
    if let Some(mb) = mesh.microbatch_axis() {
        microbatch_inputs(&mut g, mesh, &mb.name.clone(), mb.size)?;
    }
    Ok(g)
}

/// An error unless mesh axis `axis` of size `n` divides dim `dim` (`what`: its name in
/// the message) of argument `i`; `hint` ends the message.
fn dim_divides(
    g: &Graph,
    i: usize,
    (dim, what): (usize, &str),
    (axis, n): (&str, i64),
    hint: &str,
) -> Result<(), Diagnostics> {
    let a = &g.args[i];
    let size = g.values[a.value].shape[dim];
    if size % n == 0 {
        return Ok(());
    }
    Err(error(
        &g.loc,
        format!(
            "plan: argument {i}{} has {what} dim {size}, which {axis} = {n} does not divide{hint}",
            a.name().map(|s| format!(" '{s}'")).unwrap_or_default(),
        ),
    ))
}

/// Splits every data input's dim 1 (its positions) over mesh axis `axis` of size `n`,
/// inside the axes already splitting it; inputs whose layout the user wrote (`given`) and
/// rank-1 ones stay.
fn split_positions(
    g: &mut Graph,
    mesh: &Mesh,
    given: &[bool],
    axis: &str,
    n: i64,
) -> Result<(), Diagnostics> {
    for (i, &user_given) in given.iter().enumerate() {
        let a = &g.args[i];
        let ty = &g.values[a.value];
        if a.is_param() || a.attrs.contains_key("nns.state_of") || ty.shape.len() < 2 || user_given
        {
            continue;
        }
        dim_divides(g, i, (1, "sequence"), (axis, n), "")?;
        let mut axes = layout_axes(g, i)?;
        axes.push((axis.into(), AxisLayout::D(1)));
        set_layout(g, i, mesh, axes);
    }
    Ok(())
}

/// Optimizer state (`nns.state_of = "<param>"`, from `--optimizer`) takes its parameter's
/// layout, so the update runs where the parameter lives.
pub(crate) fn state_layouts(g: &mut Graph) {
    for i in 0..g.args.len() {
        let Some(AttrValue::Str(p)) = g.args[i].attrs.get("nns.state_of").cloned() else {
            continue;
        };
        if g.args[i].attrs.contains_key("nns.layout") {
            continue;
        }
        let layout = g
            .args
            .iter()
            .find(|a| a.is_param() && a.name() == Some(p.as_str()))
            .and_then(|a| a.attrs.get("nns.layout").cloned());
        if let Some(l) = layout {
            g.args[i].attrs.insert("nns.layout".into(), l);
        }
    }
}

/// Splits every data input's dim 0 over the micro-batch axis `mb` as well (inside the axes
/// already splitting it): each device's share of the batch is cut into `m` micro-batches.
/// The axes of argument `i`'s `nns.layout` (none without one).
fn layout_axes(g: &Graph, i: usize) -> Result<Vec<(String, AxisLayout)>, Diagnostics> {
    match g.args[i]
        .attrs
        .get("nns.layout")
        .and_then(AttrValue::layout)
    {
        Some(l) => Ok(l
            .map_err(|e| error(&g.loc, format!("plan: argument {i}: {e}")))?
            .axes
            .clone()),
        None => Ok(Vec::new()),
    }
}

fn microbatch_inputs(g: &mut Graph, mesh: &Mesh, mb: &str, m: i64) -> Result<(), Diagnostics> {
    for i in 0..g.args.len() {
        let a = &g.args[i];
        let ty = &g.values[a.value];
        if a.is_param() || a.attrs.contains_key("nns.state_of") || ty.shape.is_empty() {
            continue;
        }
        let mut axes = layout_axes(g, i)?;
        if axes.iter().any(|(x, _)| x == mb) {
            continue;
        }
        let parts: i64 = axes
            .iter()
            .filter(|(_, l)| *l == AxisLayout::D(0))
            .map(|(x, _)| mesh.axis(x).unwrap_or(1))
            .product();
        if ty.shape[0] % (parts * m) != 0 {
            return Err(error(
                &g.loc,
                format!(
                    "plan: argument {i}{} has batch dim {}, which {} micro-batches{} do not divide; choose microbatches= dividing {}",
                    a.name().map(|s| format!(" '{s}'")).unwrap_or_default(),
                    ty.shape[0],
                    m,
                    if parts > 1 { format!(" of each of its {parts} data-parallel shards") } else { String::new() },
                    ty.shape[0] / parts.max(1)
                ),
            ));
        }
        axes.push((mb.to_string(), AxisLayout::D(0)));
        set_layout(g, i, mesh, axes);
    }
    Ok(())
}

/// Checks what the policy asks of the parameters before anything else sees it: every
/// parameter layout it wrote must divide the dims it splits. The first parameter that
/// cannot be split is the error, naming the model dimension; the others are counted in a
/// note (they usually fail for the same reason, once per layer).
fn check_param_layouts(g: &Graph, policy: Policy, mesh: &Mesh) -> Result<(), Diagnostics> {
    let mut failures: Vec<String> = Vec::new();
    for (i, a) in g.args.iter().enumerate() {
        let Some(Ok(l)) = a.attrs.get("nns.layout").and_then(AttrValue::layout) else {
            continue;
        };
        if !a.is_param() {
            continue;
        }
        let ty = &g.values[a.value];
        for (axis, al) in &l.axes {
            let AxisLayout::D(d) = al else { continue };
            let parts = mesh.axis(axis).unwrap_or(1);
            let len = ty.shape.get(*d).copied().unwrap_or(1);
            if len % parts != 0 {
                failures.push(format!(
                    "plan: policy '{}' splits parameter {} ({ty}) on dim {d}, of length {len}, \
                     over {axis} = {parts}, which does not divide it",
                    policy_name(policy),
                    a.name()
                        .map(|n| format!("'{n}'"))
                        .unwrap_or_else(|| format!("{i}")),
                ));
            }
        }
    }
    let Some(first) = failures.first() else {
        return Ok(());
    };
    let mut d = Diagnostics::default();
    d.error(&g.loc, first.clone());
    if failures.len() > 1 {
        d.note(
            &g.loc,
            format!(
                "{} more parameters cannot be split either; choose mesh sizes that divide \
                 the model's dimensions",
                failures.len() - 1
            ),
        );
    }
    Err(d)
}

/// Vocabulary parallelism: embedding tables split on their rows, and an LM head (a
/// `linear` whose result reaches a cross-entropy's logits through reshapes) split on its
/// output classes, when `tp` divides the vocabulary. Propagation then turns the
/// cross-entropy into its vocabulary-parallel form.
fn vocab_parallel(g: &mut Graph, mesh: &Mesh, users: &[Vec<(usize, usize)>]) {
    let tp = mesh.axis("tp").unwrap_or(1);
    for k in 0..g.nodes.len() {
        let n = &g.nodes[k];
        if n.op == "dnn.embedding" {
            let table = n.inputs[1];
            if g.values[table].shape[0] % tp == 0 {
                if let Some(a) = param_arg(g, table) {
                    if !g.args[a].attrs.contains_key("nns.layout") {
                        set_layout(g, a, mesh, vec![("tp".into(), AxisLayout::D(0))]);
                    }
                }
            }
            continue;
        }
        if n.op != "dnn.linear" || n.attrs.contains_key("nns.split") {
            continue;
        }
        // Does the result reach a cross-entropy's logits through reshapes only?
        let mut v = n.outputs[0];
        let head = loop {
            let mut next = None;
            let mut found = false;
            for &(u, i) in &users[v] {
                match (g.nodes[u].op.as_str(), i) {
                    ("dnn.cross_entropy", 0) => found = true,
                    ("dnn.reshape" | "dnn.cast", 0) => next = Some(g.nodes[u].outputs[0]),
                    _ => {}
                }
            }
            match (found, next) {
                (true, _) => break true,
                (false, Some(w)) => v = w,
                (false, None) => break false,
            }
        };
        let classes = g.values[n.inputs[1]].shape[0];
        if !head || classes % tp != 0 {
            continue;
        }
        g.nodes[k]
            .attrs
            .insert("nns.split".into(), AttrValue::nns("split", "n = tp"));
        for &w in &g.nodes[k].inputs[1..].to_vec() {
            if let Some(a) = param_arg(g, w) {
                set_layout(g, a, mesh, vec![("tp".into(), AxisLayout::D(0))]);
            }
        }
    }
}

/// The parameter argument `v` is, or is a cast of (`--autocast` casts the weights a matrix
/// product reads), if any.
fn param_arg(g: &Graph, mut v: ValueId) -> Option<usize> {
    while let Some(n) = g
        .nodes
        .iter()
        .find(|n| n.op == "dnn.cast" && n.outputs[0] == v)
    {
        v = n.inputs[0];
    }
    g.args.iter().position(|a| a.value == v && a.is_param())
}

/// Whether a column-parallel result may pass through op `op` on its way to the
/// row-parallel linear (the op's spec says so).
fn megatron_through(op: &str) -> bool {
    nnscaler_dialects::dnn::spec(op).is_some_and(|s| s.traits.megatron_through)
}

fn megatron(g: &mut Graph, mesh: &Mesh) {
    let mut users: Vec<Vec<(usize, usize)>> = vec![Vec::new(); g.values.len()];
    for (k, n) in g.nodes.iter().enumerate() {
        for (i, &v) in n.inputs.iter().enumerate() {
            users[v].push((k, i));
        }
    }
    let linears: Vec<usize> = (0..g.nodes.len())
        .filter(|&k| g.nodes[k].op == "dnn.linear")
        .collect();
    let mut column = Vec::new();
    let mut row = Vec::new();
    for &l in &linears {
        let mut stack = vec![g.nodes[l].outputs[0]];
        let mut seen = vec![false; g.values.len()];
        let mut reached = Vec::new();
        while let Some(v) = stack.pop() {
            if std::mem::replace(&mut seen[v], true) {
                continue;
            }
            for &(k, i) in &users[v] {
                let n = &g.nodes[k];
                if n.op == "dnn.linear" && i == 0 {
                    reached.push(k);
                } else if megatron_through(&n.op) {
                    stack.extend(n.outputs.iter().copied());
                }
            }
        }
        if !reached.is_empty() {
            column.push(l);
            row.extend(reached);
        }
    }
    let split = |id: &str| AttrValue::nns("split", &format!("{id} = tp"));
    for &k in &column {
        if row.contains(&k) || g.nodes[k].attrs.contains_key("nns.split") {
            continue;
        }
        g.nodes[k].attrs.insert("nns.split".into(), split("n"));
        for &v in &g.nodes[k].inputs[1..].to_vec() {
            if let Some(a) = param_arg(g, v) {
                set_layout(g, a, mesh, vec![("tp".into(), AxisLayout::D(0))]);
            }
        }
    }
    // A linear both reached and reaching (a deeper MLP) reads a split activation: row.
    vocab_parallel(g, mesh, &users);
    for &k in &row {
        if g.nodes[k].attrs.contains_key("nns.split") {
            continue;
        }
        g.nodes[k].attrs.insert("nns.split".into(), split("k"));
        if let Some(a) = param_arg(g, g.nodes[k].inputs[1]) {
            set_layout(g, a, mesh, vec![("tp".into(), AxisLayout::D(1))]);
        }
    }
}

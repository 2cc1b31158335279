//! `--propagate-layouts`: gives every value a layout.
//!
//! Arguments keep their `nns.layout` (replicated when absent). In program order, each `dnn`
//! op takes the split of its directive (`nns.split`); an op without one follows its
//! operands: the identifier annotating each split operand dim is split over the same mesh
//! axes (see `sharding::infer_binds`), and the inferred directive is written; an op with a
//! directive gets the inferred binds for the ids and axes its directive leaves free, except
//! the axes it names replicated (`R(tp)`: its operands are gathered over them). The op's
//! result layouts follow from its annotation (`nns.layouts`). Each function result gets the
//! layout it must end with (`nns.layout`): a `grad.<p>` or `next.<p>` result that of
//! parameter (or optimizer state) `p`, anything else replicated, unless one is written.
//! A `linear` whose directive splits its summed dim is first cut into `linear` + `add` of
//! the bias, so the bias is added once, after the reduction.
//!
//! Two rules keep the weights' splits where operands disagree. Parameters (and their casts)
//! propose their splits before the other operands when those splits are over the
//! parameter's compute axes (`compute_axes`: the axes the directives of the ops reading it
//! split it over), so `dy · W` of a row-parallel weight gathers `dy` rather than `W`. And
//! an op without a directive whose result is a weight gradient (`wanted_grads`) proposes
//! its parameter's layout over those axes first, so the gradient is made in the split its
//! parameter is used in.
//!
//! A result dim that is new (an output-only identifier: `broadcast_to` into new leading
//! dims, `a b -> n=8 a b` of a user op) is never split by its operands. When the one
//! consumer of such a result (or the function result it is), directly or through a chain of
//! single-use ops, needs it split on that dim, the chain is split there instead, if nothing
//! fixed its splits: each device makes its piece, where a relayout would have made the
//! whole and cut it (see `amend`).
//!
//! A partial value that one consumer needs reduce-scattered while others would let the
//! partial sum flow on is reduced once, right after its producer, for all of them: a
//! second pass, run when the first finds such values (see `propagate_with`).

use crate::layouts::{
    annotation, constraint, directive, error, layout_attr, layouts_attr, node_layouts,
    replicated_axes, split_directive, the_mesh, value_layouts,
};
use crate::pass::{FunctionPass, PassOptions};
use melior::ir::OperationRef;
use nnscaler_dialects::annotation::{Annotation, Binding, DimKind};
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::ValueId;
use nnscaler_dialects::graph::{Graph, Node};
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::sharding::{infer_binds_in, Binds, Sharding};
use nnscaler_dialects::types::{AttrValue, Attrs};
use std::collections::HashMap;

/// The pass.
#[derive(Debug, Default)]
pub struct PropagateLayouts {
    mesh: Option<Mesh>,
    remarks: Diagnostics,
}

impl PropagateLayouts {
    /// No options.
    pub fn new(_: &PassOptions) -> Result<Self, String> {
        Ok(PropagateLayouts::default())
    }
}

impl FunctionPass for PropagateLayouts {
    fn prepare(&mut self, module: &OperationRef<'_, '_>) -> Result<(), Diagnostics> {
        self.mesh = Some(the_mesh(module, "propagate-layouts")?);
        Ok(())
    }
    fn run_on_function(&mut self, g: Graph) -> Result<Option<Graph>, Diagnostics> {
        let mesh = self.mesh.as_ref().expect("prepare runs first");
        propagate(g, mesh, &mut self.remarks).map(Some)
    }
    fn take_remarks(&mut self) -> Diagnostics {
        std::mem::take(&mut self.remarks)
    }
}

/// A `linear` with a bias whose directive splits the summed dim `k` would add the bias on
/// every device of a partial sum. It becomes `linear` without bias (partial) followed by
/// `add` of the bias, which propagation then places after the reduction.
///
/// Returns whether it cut; an error when the bias's init rule is ambiguous.
fn split_bias(g: &mut Graph, k: usize, anno: &Annotation, binds: &Binds) -> Result<bool, String> {
    let n = &g.nodes[k];
    if n.op != "dnn.linear" || n.inputs.len() != 3 {
        return Ok(false);
    }
    if !binds.iter().any(|(id, _)| anno.kind(id) == DimKind::Summed) {
        return Ok(false);
    }
    let mut lin = n.clone();
    let bias = lin.inputs.pop().unwrap_or_default();
    // The bias stops being a `linear` operand: pin the init rule that usage implied, so
    // seeded initialization draws the same values before and after partitioning (the
    // parameter itself, or the one whose bf16 copy `--autocast` gave the linear).
    let mut source = bias;
    while let Some(c) = g
        .nodes
        .iter()
        .find(|c| c.op == "dnn.cast" && c.outputs.first() == Some(&source))
    {
        source = c.inputs[0];
    }
    if let Some(a) = g
        .args
        .iter()
        .position(|a| a.value == source && a.is_param())
    {
        if !g.args[a].attrs.contains_key("nns.init") {
            let rule = g.init_rule(a)?;
            g.args[a]
                .attrs
                .insert("nns.init".into(), AttrValue::Str(rule.to_string()));
        }
    }
    let y = lin.outputs[0];
    let partial = g.new_value(g.values[y].clone());
    lin.outputs = vec![partial];
    let add = Node {
        op: "dnn.add".into(),
        inputs: vec![partial, bias],
        outputs: vec![y],
        attrs: Attrs::new(),
        loc: lin.loc.clone(),
        origin: None,
    };
    g.nodes[k] = lin;
    g.nodes.insert(k + 1, add);
    Ok(true)
}

/// Checks an op's final binds before they are written: every split divides its dim (the
/// first op that cannot be split is the error, not every op after it), the op's `nns.pin`
/// is kept and its `nns.forbid` respected. Messages say whether a split was written (by
/// `--plan` or the input) or inferred from the operands.
fn check_binds(
    binds: &Binds,
    written: Option<&Binds>,
    pin: Option<&Binds>,
    forbid: Option<&Binds>,
    anno: &Annotation,
    binding: &Binding,
    mesh: &Mesh,
) -> Result<(), String> {
    let names = |axes: &[usize]| {
        axes.iter()
            .map(|&a| mesh.axes[a].name.as_str())
            .collect::<Vec<_>>()
            .join("*")
    };
    let origin = |id: &str| {
        if written.is_some_and(|w| w.iter().any(|(i, _)| i == id)) {
            "its split directive (nns.split or nns.pin)"
        } else {
            "the layouts of its operands"
        }
    };
    for (id, axes) in binds {
        let parts: i64 = axes.iter().map(|&a| mesh.axes[a].size).product();
        let len = binding.len(id).unwrap_or(1);
        if len % parts != 0 {
            let at = anno.where_is(binding, id);
            return Err(format!(
                "dimension '{id}'{at} has length {len}, but {} split it over {} ({parts} \
                 devices), which does not divide it; the mesh sizes must divide this dimension",
                origin(id),
                names(axes)
            ));
        }
    }
    for (id, axes) in pin.into_iter().flatten() {
        if !binds.iter().any(|(i, a)| i == id && a == axes) {
            return Err(format!(
                "its nns.pin requires '{id}' split over {}, but {} decide otherwise",
                names(axes),
                origin(id)
            ));
        }
    }
    for (id, axes) in forbid.into_iter().flatten() {
        if let Some((_, used)) = binds
            .iter()
            .find(|(i, a)| i == id && a.iter().any(|x| axes.contains(x)))
        {
            return Err(format!(
                "{} split '{id}' over {}, which its nns.forbid forbids",
                origin(id),
                names(used)
            ));
        }
    }
    Ok(())
}

/// Whether the logits of a cross-entropy (or its gradient) arrive split on the class dim.
fn vocab_split(n: &Node, layouts: &[Option<Sharding>]) -> bool {
    let logits = if n.op == "dnn.cross_entropy" {
        n.inputs[0]
    } else {
        n.inputs[1]
    };
    layouts[logits]
        .as_ref()
        .is_some_and(|l| l.split.last().is_some_and(|a| !a.is_empty()))
}

/// Replaces node `k`, a cross-entropy (or its gradient) whose logits are split on the
/// class dim, by ops that run on class shards with explicit reductions (Megatron's
/// vocabulary-parallel cross-entropy):
/// `m = max(l)` (partial maxima, all_reduce(max)); `lse = log(sum(exp(l - m))) + m`
/// (partial sums, all_reduce); forward `loss = mean(lse - pick(l, t))` (`pick` gives 0 on
/// shards without the target: partial sums); backward
/// `softmax_xent_grad(dloss, l, t, lse)`, which needs no communication.
fn vocab_parallel_cross_entropy(g: &mut Graph, k: usize) -> Result<(), String> {
    let n = g.nodes[k].clone();
    let forward = n.op == "dnn.cross_entropy";
    let (l, t) = if forward {
        (n.inputs[0], n.inputs[1])
    } else {
        (n.inputs[1], n.inputs[2])
    };
    // Logits [tokens.., classes]: reductions over the last dim, the loss's mean over the
    // token dims.
    let shape = g.values[l].shape.clone();
    let v = shape.len() as i64 - 1;
    let tokens = shape[..shape.len() - 1].to_vec();
    let count = n.attrs.get("count").cloned();
    let start = g.nodes.len();
    let loc = n.loc.clone();
    // Each new op runs where the replaced one did (its stage, layer, recompute mark).
    let placed = nnscaler_dialects::nns::placement_of(&n.attrs);
    let attrs = |kv: &[(&str, AttrValue)]| -> Attrs {
        let mut a = placed.clone();
        a.extend(kv.iter().map(|(a, b)| (a.to_string(), b.clone())));
        a
    };
    let dims1 = || {
        attrs(&[
            ("dims", AttrValue::Ints(vec![v])),
            ("keepdim", AttrValue::Bool(true)),
        ])
    };
    let m = g.add1("dnn.max", &[l], dims1(), &loc)?;
    let z = g.add1("dnn.sub", &[l, m], attrs(&[]), &loc)?;
    let e = g.add1("dnn.exp", &[z], attrs(&[]), &loc)?;
    let s = g.add1("dnn.sum", &[e], dims1(), &loc)?;
    let ls = g.add1("dnn.log", &[s], attrs(&[]), &loc)?;
    let lse = g.add1("dnn.add", &[ls, m], attrs(&[]), &loc)?;
    if forward {
        let lse1 = g.add1(
            "dnn.reshape",
            &[lse],
            attrs(&[("shape", AttrValue::Ints(tokens.clone()))]),
            &loc,
        )?;
        let p = g.add1("dnn.pick", &[l, t], attrs(&[]), &loc)?;
        let d = g.add1("dnn.sub", &[lse1, p], attrs(&[]), &loc)?;
        let mut a = attrs(&[("dims", AttrValue::Ints((0..v).collect()))]);
        if let Some(c) = count {
            a.insert("count".into(), c);
        }
        g.add1("dnn.mean", &[d], a, &loc)?;
    } else {
        let c = count.unwrap_or(AttrValue::Int(tokens.iter().product()));
        g.add1(
            "dnn.softmax_xent_grad",
            &[n.inputs[0], l, t, lse],
            attrs(&[("count", c)]),
            &loc,
        )?;
    }
    // The last new op defines the replaced op's result, so its users are unchanged.
    let mut new: Vec<Node> = g.nodes.drain(start..).collect();
    if let Some(tail) = new.last_mut() {
        tail.outputs = vec![n.outputs[0]];
    }
    g.nodes.splice(k..=k, new);
    Ok(())
}

/// Propagates layouts through `g` (see the module docs). An op of another dialect (no
/// spec, so no annotation to split by) runs replicated, as MLIR's own spmdization treats
/// ops without a sharding interface: its result layouts are written replicated (split-tensor
/// then gathers its operands), and a remark says so.
pub fn propagate(g: Graph, mesh: &Mesh, remarks: &mut Diagnostics) -> Result<Graph, Diagnostics> {
    propagate_with(g, mesh, remarks, false).map(|(g, _)| g)
}

/// The final binds of an op and the axes it was left replicated over.
pub type Decided = (Binds, Vec<usize>);

/// [`propagate`] where an inferred split that does not divide its dimension is dropped
/// instead of refused: the op runs replicated over those axes (its operand is gathered).
/// Also returns, per op of the input graph, the binds it was given and the axes dropped
/// (`None` for ops that are not `dnn` ops or were replaced), so a planner can write them
/// as directives that plain propagation then follows.
pub fn propagate_lenient(
    g: Graph,
    mesh: &Mesh,
    remarks: &mut Diagnostics,
) -> Result<(Graph, Vec<Option<Decided>>), Diagnostics> {
    propagate_with(g, mesh, remarks, true)
}

/// Per value, the parameter argument (index into `g.args`) it is a copy of: the
/// parameter's own value and `dnn.cast`s of one (autocast's bf16 copies).
fn param_copies(g: &Graph) -> Vec<Option<usize>> {
    let mut of = vec![None; g.values.len()];
    for (i, a) in g.args.iter().enumerate() {
        if a.is_param() {
            of[a.value] = Some(i);
        }
    }
    for n in &g.nodes {
        if n.op == "dnn.cast" && n.inputs.len() == 1 {
            if let (Some(p), Some(&o)) = (of[n.inputs[0]], n.outputs.first()) {
                of[o] = Some(p);
            }
        }
    }
    of
}

/// Per parameter argument, its compute axes: the mesh axes that the directives of the ops
/// reading it (optimizer ops aside) split it over. Megatron's `n = tp` on a linear makes
/// `tp` a compute axis of its weight; ZeRO's sharding of a parameter over `dp` is not one
/// (the forward gathers it).
fn compute_axes(g: &Graph, mesh: &Mesh, copies: &[Option<usize>]) -> Vec<Vec<usize>> {
    let mut axes = vec![Vec::new(); g.args.len()];
    for n in &g.nodes {
        if !n.op.starts_with("dnn.") || n.op.spec().is_some_and(|s| s.traits.optimizer) {
            continue;
        }
        let Ok(Some(binds)) = directive(n, mesh) else {
            continue;
        };
        let none = vec![None; n.inputs.len()];
        let Ok(l) = node_layouts(g, n, mesh, &binds, &none) else {
            continue;
        };
        for (i, &v) in n.inputs.iter().enumerate() {
            let (Some(p), Some(Some(s))) = (copies[v], l.inputs.get(i)) else {
                continue;
            };
            for &a in s.split.iter().flatten() {
                if !axes[p].contains(&a) {
                    axes[p].push(a);
                }
            }
        }
    }
    axes
}

/// Sharding `s`'s split per dim restricted to mesh `axes` (a parameter's compute axes).
fn split_over(s: &Sharding, axes: &[usize]) -> Vec<Vec<usize>> {
    s.split
        .iter()
        .map(|d| d.iter().copied().filter(|a| axes.contains(a)).collect())
        .collect()
}

/// Per value, the layout a weight gradient should be computed in: a `grad.<p>` result
/// (and, backwards through the `dnn.cast`s and same-shape `dnn.add`s accumulating it, the
/// values it is made of) wants parameter `p`'s layout over `p`'s compute axes. Seeding an
/// op's binds from it computes the gradient in the split its parameter is used in (a
/// row-parallel weight's gradient split on its columns, the positions' split of `dy`
/// gathered) instead of following `dy`'s split into a partial sum that is then
/// all-to-all'd or reduce-scattered into place.
fn wanted_grads(
    g: &Graph,
    layouts: &[Option<Sharding>],
    compute: &[Vec<usize>],
) -> Vec<Option<Sharding>> {
    let mut want: Vec<Option<Sharding>> = vec![None; g.values.len()];
    for o in &g.outputs {
        let Some(p) = o.name().and_then(|n| n.strip_prefix("grad.")) else {
            continue;
        };
        let Some(i) = g
            .args
            .iter()
            .position(|a| a.is_param() && a.name() == Some(p))
        else {
            continue;
        };
        let Some(s) = layouts[g.args[i].value].as_ref() else {
            continue;
        };
        let split = split_over(s, &compute[i]);
        if split.iter().all(Vec::is_empty) || split.len() != g.values[o.value].rank() {
            continue;
        }
        want[o.value] = Some(Sharding {
            split,
            partial: vec![None; s.partial.len()],
        });
    }
    for n in g.nodes.iter().rev() {
        let Some(w) = n.outputs.first().and_then(|&o| want[o].clone()) else {
            continue;
        };
        if n.op == "dnn.cast" || n.op == "dnn.add" {
            let shape = &g.values[n.outputs[0]].shape;
            for &v in &n.inputs {
                if &g.values[v].shape == shape && want[v].is_none() {
                    want[v] = Some(w.clone());
                }
            }
        }
    }
    want
}

/// The order in which an op's operands propose splits: parameters (and their casts) split
/// over their compute axes first, proposing that split only, so a weight keeps the split
/// its directives gave it and the activation it meets is gathered (`dy · W` of a
/// row-parallel weight under Megatron-SP gathers `dy`'s positions rather than the
/// weight), then the rest in order. A ZeRO-3 parameter's `dp` split is no compute axis
/// (the forward and the backward gather it): it neither proposes nor keeps the weight
/// from going first. Returns the order and, per operand, the split it proposes when
/// that is not its layout (a first parameter's split over its compute axes).
fn operand_order(
    n: &Node,
    layouts: &[Option<Sharding>],
    copies: &[Option<usize>],
    compute: &[Vec<usize>],
) -> (Vec<usize>, Vec<Option<Sharding>>) {
    let mut proposes: Vec<Option<Sharding>> = vec![None; n.inputs.len()];
    let mut first = Vec::new();
    let mut rest = Vec::new();
    for (i, &v) in n.inputs.iter().enumerate() {
        let own = copies[v].and_then(|p| Some((p, layouts[v].as_ref()?)));
        let Some((p, s)) = own else {
            rest.push(i);
            continue;
        };
        let split = split_over(s, &compute[p]);
        if split.iter().all(Vec::is_empty) {
            rest.push(i);
            continue;
        }
        first.push(i);
        if split != s.split {
            proposes[i] = Some(Sharding {
                split,
                partial: s.partial.clone(),
            });
        }
    }
    first.extend(rest);
    (first, proposes)
}

/// Values to reduce as soon as they are made, by the layout to reduce them to.
type Eager = HashMap<ValueId, Sharding>;

/// Per result of an op whose split propagation chose alone (no directive, pin or forbid
/// written), the binds it chose and the axes it left replicated: such an op may still be
/// split further for its consumer (see [`amend`]).
type Free = HashMap<ValueId, Decided>;

/// A producer's new split: node index, binds, result layouts.
type Amendment = (usize, Binds, Vec<Sharding>);

/// Gives `v` layout `need` by splitting its producer further rather than cutting the
/// value after it: the producer of `v` takes `need`'s extra splits, and so, recursively,
/// do the producers of the operands that split then needs, down to a new dimension (an
/// output-only identifier, `broadcast_to` into new dims), which needs nothing from its
/// operands. Each value on the way must be its producer's only result with exactly one
/// use, made by an op whose split is free (`free`), replicated where it gains a split and
/// not partial. Returns the nodes it split further (index in `g`, their binds and
/// replicated axes), none when `v` could not have layout `need` (then nothing changed).
/// Without new dimensions it never applies: propagation already split everything its
/// operands allowed.
fn amend(
    g: &mut Graph,
    mesh: &Mesh,
    layouts: &mut [Option<Sharding>],
    free: &mut Free,
    v: ValueId,
    need: &Sharding,
) -> Result<Vec<(usize, Decided)>, String> {
    let mut plan = Vec::new();
    if !plan_amend(g, mesh, layouts, free, v, need, &mut plan, 0)? {
        return Ok(Vec::new());
    }
    let mut changed = Vec::new();
    for (p, binds, outs) in plan {
        let o = g.nodes[p].outputs[0];
        let closed = free[&o].1.clone();
        if let Some(d) = split_directive(&binds, &closed, mesh) {
            g.nodes[p].attrs.insert("nns.split".into(), d);
        }
        g.nodes[p]
            .attrs
            .insert("nns.layouts".into(), layouts_attr(&outs, mesh));
        layouts[o] = outs.into_iter().next();
        free.get_mut(&o).expect("planned from it").0 = binds.clone();
        changed.push((p, (binds, closed)));
    }
    Ok(changed)
}

/// [`amend`]'s search: pushes the producers' new splits onto `plan`, returns whether `v`
/// can have layout `need`.
#[allow(clippy::too_many_arguments)]
fn plan_amend(
    g: &Graph,
    mesh: &Mesh,
    layouts: &[Option<Sharding>],
    free: &Free,
    v: ValueId,
    need: &Sharding,
    plan: &mut Vec<Amendment>,
    depth: usize,
) -> Result<bool, String> {
    let Some(have) = layouts[v].as_ref() else {
        return Ok(false);
    };
    if have == need {
        return Ok(true);
    }
    let Some((binds, closed)) = free.get(&v) else {
        return Ok(false);
    };
    let partial = |s: &Sharding| s.partial.iter().any(Option::is_some);
    if depth > 64 || partial(have) || partial(need) {
        return Ok(false);
    }
    let uses = g
        .nodes
        .iter()
        .flat_map(|n| &n.inputs)
        .filter(|&&x| x == v)
        .count()
        + g.outputs.iter().filter(|o| o.value == v).count();
    let Some(p) = g.nodes.iter().position(|n| n.outputs.contains(&v)) else {
        return Ok(false);
    };
    let n = &g.nodes[p];
    if uses != 1 || n.outputs.len() != 1 {
        return Ok(false);
    }
    let (anno, binding) = annotation(g, n)?;
    let choices = anno.split_choices(&binding);
    let mut binds = binds.clone();
    for (d, (had, want)) in have.split.iter().zip(&need.split).enumerate() {
        if had == want {
            continue;
        }
        if !had.is_empty() {
            return Ok(false);
        }
        let Some(c) = choices.iter().find(|c| {
            c.kind == DimKind::Spatial
                && c.positions
                    .iter()
                    .any(|q| q.output && q.tensor == 0 && q.dim == d)
        }) else {
            return Ok(false);
        };
        let parts: i64 = want.iter().map(|&a| mesh.axes[a].size).product();
        let taken = binds
            .iter()
            .any(|(i, axes)| *i == c.id || axes.iter().any(|a| want.contains(a)))
            || want.iter().any(|a| closed.contains(a));
        if taken || binding.len(&c.id).unwrap_or(1) % parts != 0 {
            return Ok(false);
        }
        binds.push((c.id.clone(), want.clone()));
    }
    let ops: Vec<Option<&Sharding>> = n.inputs.iter().map(|&x| layouts[x].as_ref()).collect();
    let l = node_layouts(g, n, mesh, &binds, &ops)?;
    if l.outputs.first() != Some(need) {
        return Ok(false);
    }
    let mark = plan.len();
    for (&u, want) in n.inputs.iter().zip(&l.inputs) {
        let Some(want) = want else { continue };
        if !plan_amend(g, mesh, layouts, free, u, want, plan, depth + 1)? {
            plan.truncate(mark);
            return Ok(false);
        }
    }
    plan.push((p, binds, l.outputs));
    Ok(true)
}

/// Propagation in two passes when the first finds partial values that one consumer needs
/// reduce-scattered while others let the partial sum flow on (an attention gradient's
/// `dk` under context parallelism: reduce-scattered for its weight gradient, flowing
/// partial through `dk · W` into a sum reduce-scattered again). The second pass reduces
/// each such value once, right after its producer (an `nns.relayout` to the layout the
/// reducing consumer needs), and every consumer reads the reduced shard: a reduction the
/// program makes anyway serves them all, instead of one more later.
fn propagate_with(
    g: Graph,
    mesh: &Mesh,
    remarks: &mut Diagnostics,
    lenient: bool,
) -> Result<(Graph, Vec<Option<Decided>>), Diagnostics> {
    let mut first = Diagnostics::default();
    let (out, decided, eager) =
        propagate_pass(g.clone(), mesh, &mut first, lenient, &Eager::new())?;
    if eager.is_empty() {
        remarks.extend(first);
        return Ok((out, decided));
    }
    let (out, decided, _) = propagate_pass(g, mesh, remarks, lenient, &eager)?;
    Ok((out, decided))
}

fn propagate_pass(
    mut g: Graph,
    mesh: &Mesh,
    remarks: &mut Diagnostics,
    lenient: bool,
    eager: &Eager,
) -> Result<(Graph, Vec<Option<Decided>>, Eager), Diagnostics> {
    let mut layouts = value_layouts(&g, mesh)?;
    // The input's values (those the second pass can name).
    let given = g.values.len();
    // Partial values some consumer needs reduced, and those some consumer reads partial.
    let mut reduce_to: Eager = Eager::new();
    let mut flows: Vec<bool> = vec![false; given];
    // Each node's index in the input graph (`None` for nodes propagation made).
    let mut orig: Vec<Option<usize>> = (0..g.nodes.len()).map(Some).collect();
    let mut decided: Vec<Option<Decided>> = vec![None; g.nodes.len()];
    let copies = param_copies(&g);
    let compute = compute_axes(&g, mesh, &copies);
    let want = wanted_grads(&g, &layouts, &compute);
    let mut free = Free::new();
    let mut k = 0;
    while k < g.nodes.len() {
        let mut n = g.nodes[k].clone();
        let ranks: Vec<usize> = n.outputs.iter().map(|&v| g.values[v].rank()).collect();
        let user = g.user_ops.of_call(&n.op, &n.attrs).is_some();
        if !user && is_foreign(&n.op) {
            run_replicated(&mut g, k, mesh, &mut layouts, remarks);
            k += 1;
            continue;
        }
        if !user && !n.op.starts_with("dnn.") {
            // nns ops: their layouts are written (relayouts) or replicated.
            for (j, &v) in n.outputs.iter().enumerate() {
                if layouts[v].is_none() {
                    layouts[v] = Some(Sharding::replicated(ranks[j], mesh.axes.len()));
                }
            }
            k += 1;
            continue;
        }
        if (n.op == "dnn.cross_entropy" || n.op == "dnn.cross_entropy_grad")
            && vocab_split(&n, &layouts)
        {
            let before = g.nodes.len();
            vocab_parallel_cross_entropy(&mut g, k)
                .map_err(|e| error(&n.loc, format!("propagate-layouts: '{}': {e}", n.op)))?;
            let made = g.nodes.len() + 1 - before;
            orig.splice(k..=k, std::iter::repeat_n(None, made));
            layouts.resize(g.values.len(), None);
            continue; // propagate through the ops that replaced it
        }
        let fail = |e: String| error(&n.loc, format!("propagate-layouts: '{}': {e}", n.op));
        // The directive's binds first; inference from the operands fills in the ids and
        // mesh axes the directive leaves free (a `n = tp` directive under data
        // parallelism keeps the batch split on dp).
        let pin = constraint(&n, "nns.pin", mesh).map_err(fail)?;
        let forbid = constraint(&n, "nns.forbid", mesh).map_err(fail)?;
        // A pinned op without a directive takes its pin as the directive.
        let split_attr = directive(&n, mesh).map_err(fail)?;
        let written = split_attr.clone().or_else(|| pin.clone());
        let (anno, binding) = annotation(&g, &n).map_err(fail)?;
        let ops: Vec<Option<&Sharding>> = n.inputs.iter().map(|&v| layouts[v].as_ref()).collect();
        let mut binds = written.clone().unwrap_or_default();
        let mut closed = replicated_axes(&n, mesh).map_err(fail)?;
        // Without a directive, a result that is a weight gradient proposes its wanted
        // split first (see `wanted_grads`).
        let mut proposed = if written.is_none() {
            wanted_binds(&n, &anno, &binding, &want)
        } else {
            Vec::new()
        };
        // Values propagation made (the vocabulary-parallel ops') have no copies entry.
        let (order, proposes) = if n.inputs.iter().all(|&v| v.index() < copies.len()) {
            operand_order(&n, &layouts, &copies, &compute)
        } else {
            ((0..n.inputs.len()).collect(), vec![None; n.inputs.len()])
        };
        let proposing: Vec<Option<&Sharding>> = ops
            .iter()
            .zip(&proposes)
            .map(|(&o, p)| p.as_ref().or(o))
            .collect();
        proposed.extend(infer_binds_in(&anno, &binding, &proposing, &order));
        for (id, axes) in proposed {
            let taken = binds
                .iter()
                .any(|(i, v)| *i == id || v.iter().any(|a| axes.contains(a)))
                || axes.iter().any(|a| closed.contains(a));
            if !taken {
                let parts: i64 = axes.iter().map(|&a| mesh.axes[a].size).product();
                let divides = binding.len(&id).unwrap_or(1) % parts == 0;
                if lenient && !divides {
                    for a in axes {
                        if !closed.contains(&a) {
                            closed.push(a);
                        }
                    }
                } else {
                    binds.push((id, axes));
                }
            }
        }
        check_binds(
            &binds,
            written.as_ref(),
            pin.as_ref(),
            forbid.as_ref(),
            &anno,
            &binding,
            mesh,
        )
        .map_err(fail)?;
        if !binds.is_empty() && split_attr.as_ref() != Some(&binds) {
            if let Some(d) = split_directive(&binds, &closed, mesh) {
                g.nodes[k].attrs.insert("nns.split".into(), d);
            }
        }
        if let Some(i) = orig[k] {
            decided[i] = Some((binds.clone(), closed.clone()));
        }
        let cut = split_bias(&mut g, k, &anno, &binds)
            .map_err(|e| error(&n.loc, format!("propagate-layouts: '{}': {e}", n.op)))?;
        if cut {
            orig.insert(k + 1, None);
            layouts.resize(g.values.len(), None);
            n = g.nodes[k].clone();
        }
        let ops: Vec<Option<&Sharding>> = n.inputs.iter().map(|&v| layouts[v].as_ref()).collect();
        let l = node_layouts(&g, &n, mesh, &binds, &ops)
            .map_err(|e| error(&n.loc, format!("propagate-layouts: '{}': {e}", n.op)))?;
        // An operand that is a new dimension's broadcast, needed split on it: its
        // producer makes the pieces instead.
        for (&v, need) in n.inputs.iter().zip(&l.inputs) {
            if let (Some(need), Some(have)) = (need, layouts[v].as_ref()) {
                if have != need {
                    let changed =
                        amend(&mut g, mesh, &mut layouts, &mut free, v, need).map_err(|e| {
                            error(&n.loc, format!("propagate-layouts: '{}': {e}", n.op))
                        })?;
                    for (p, d) in changed {
                        if let Some(i) = orig[p] {
                            decided[i] = Some(d);
                        }
                    }
                }
            }
        }
        for (&v, need) in n.inputs.iter().zip(&l.inputs) {
            let (Some(have), Some(need)) = (layouts[v].as_ref(), need) else {
                continue;
            };
            if v.index() >= given {
                continue;
            }
            for (a, p) in have.partial.iter().enumerate() {
                if p.is_none() {
                    continue;
                }
                if need.partial[a].is_some() {
                    flows[v] = true;
                } else if need.split.iter().any(|d| d.contains(&a)) {
                    // Reduced onto a split (a reduce_scatter): the consumers that read
                    // it partial would then work on shards. (An all_reduce to replicated
                    // saves nothing there: a later partial sum would only need
                    // partitions to join it.)
                    reduce_to.entry(v).or_insert_with(|| need.clone());
                }
            }
        }
        g.nodes[k]
            .attrs
            .insert("nns.layouts".into(), layouts_attr(&l.outputs, mesh));
        let outputs = n.outputs.clone();
        for (&v, s) in outputs.iter().zip(l.outputs) {
            layouts[v] = Some(s);
            if written.is_none() && forbid.is_none() {
                free.insert(v, (binds.clone(), closed.clone()));
            }
        }
        // A value to reduce at once: a relayout after its producer, read by every later
        // consumer (and result) instead.
        for &v in &outputs {
            if let Some(to) = eager.get(&v) {
                reduce_now(&mut g, mesh, k, v, to, &mut layouts);
                orig.insert(k + 1, None);
                k += 1;
            }
        }
        k += 1;
    }
    let eager_next: Eager = reduce_to.into_iter().filter(|(v, _)| flows[*v]).collect();
    let changed = result_layouts(&mut g, mesh, &mut layouts, &mut free)?;
    for (p, d) in changed {
        if let Some(i) = orig[p] {
            decided[i] = Some(d);
        }
    }
    Ok((g, decided, eager_next))
}

/// The binds that give node `n`'s results the splits wanted for them (`want`, from
/// [`wanted_grads`]): per result dim wanted split, the identifier sitting there.
fn wanted_binds(
    n: &Node,
    anno: &Annotation,
    binding: &Binding,
    want: &[Option<Sharding>],
) -> Binds {
    let mut proposed = Vec::new();
    let choices = anno.split_choices(binding);
    for (j, &o) in n.outputs.iter().enumerate() {
        let Some(w) = want.get(o.index()).and_then(Option::as_ref) else {
            continue;
        };
        for (d, axes) in w.split.iter().enumerate() {
            let c = choices.iter().find(|c| {
                c.positions
                    .iter()
                    .any(|p| p.output && p.tensor == j && p.dim == d)
            });
            if let (Some(c), false) = (c, axes.is_empty()) {
                proposed.push((c.id.clone(), axes.clone()));
            }
        }
    }
    proposed
}

/// An op of another dialect (node `k`) runs replicated: its results are written
/// replicated, and a remark says so on a mesh of more than one device.
fn run_replicated(
    g: &mut Graph,
    k: usize,
    mesh: &Mesh,
    layouts: &mut [Option<Sharding>],
    remarks: &mut Diagnostics,
) {
    let n = &g.nodes[k];
    let rs: Vec<Sharding> = n
        .outputs
        .iter()
        .map(|&v| Sharding::replicated(g.values[v].rank(), mesh.axes.len()))
        .collect();
    if mesh.devices() > 1 {
        remarks.remark(
            &n.loc,
            format!(
                "propagate-layouts: '{}' has no dnn spec; it runs replicated (its operands are gathered, its results replicated on every device)",
                n.op
            ),
        );
    }
    for (&v, s) in n.outputs.iter().zip(&rs) {
        layouts[v] = Some(s.clone());
    }
    g.nodes[k]
        .attrs
        .insert("nns.layouts".into(), layouts_attr(&rs, mesh));
}

/// Value `v` of node `k` reduced at once to `to`: an `nns.relayout` right after node
/// `k`, read by every later consumer and result instead of `v`.
fn reduce_now(
    g: &mut Graph,
    mesh: &Mesh,
    k: usize,
    v: ValueId,
    to: &Sharding,
    layouts: &mut Vec<Option<Sharding>>,
) {
    let mut attrs = Attrs::new();
    attrs.insert("to".into(), layout_attr(to, mesh));
    let ty = g.values[v].clone();
    let loc = g.nodes[k].loc.clone();
    let r = g.add_raw("nns.relayout", &[v], vec![ty], attrs, &loc)[0];
    let node = g.nodes.pop().expect("the relayout just made");
    for m in &mut g.nodes[k + 1..] {
        for x in &mut m.inputs {
            if *x == v {
                *x = r;
            }
        }
    }
    for o in &mut g.outputs {
        if o.value == v {
            o.value = r;
        }
    }
    g.nodes.insert(k + 1, node);
    layouts.resize(g.values.len(), None);
    layouts[r] = Some(to.clone());
}

/// The layout each function result ends in (`nns.layout`): a written one is kept (and a
/// new dimension's broadcast producing it is split to match, [`amend`]); a `grad.<p>` or
/// `next.<p>` result takes trained state `p`'s layout (the next step reads it back as is,
/// so it is never gathered); anything else is replicated. Returns the nodes [`amend`]
/// split further.
fn result_layouts(
    g: &mut Graph,
    mesh: &Mesh,
    layouts: &mut [Option<Sharding>],
    free: &mut Free,
) -> Result<Vec<(usize, Decided)>, Diagnostics> {
    let mut changed = Vec::new();
    // Trained state (parameters and optimizer moments) by name: a gradient leaves in its
    // parameter's layout, a next value in its state's (the next step reads it back as is,
    // so it is never gathered).
    let params: Vec<(String, Option<Sharding>)> = g
        .args
        .iter()
        .filter(|a| a.is_state())
        .map(|a| (a.name().unwrap_or("").to_string(), layouts[a.value].clone()))
        .collect();
    // A result whose layout is written (a user op's body, specialized for a call) that is
    // a new dimension's broadcast: its producer makes the pieces.
    for i in 0..g.outputs.len() {
        let o = &g.outputs[i];
        let Some(attr) = o.attrs.get("nns.layout") else {
            continue;
        };
        let v = o.value;
        let want = Sharding::from_attr(attr, mesh, g.values[v].rank())
            .map_err(|e| error(&g.loc, format!("propagate-layouts: result {i}: {e}")))?;
        if layouts[v].as_ref().is_some_and(|h| *h != want) {
            changed.extend(
                amend(g, mesh, layouts, free, v, &want)
                    .map_err(|e| error(&g.loc, format!("propagate-layouts: result {i}: {e}")))?,
            );
        }
    }
    for o in &mut g.outputs {
        if o.attrs.contains_key("nns.layout") {
            continue;
        }
        let rank = g.values[o.value].rank();
        let grad_of = o
            .name()
            .and_then(|n| n.strip_prefix("grad.").or_else(|| n.strip_prefix("next.")))
            .map(str::to_string);
        let want = grad_of
            .and_then(|p| {
                params
                    .iter()
                    .find(|(n, _)| *n == p)
                    .and_then(|(_, s)| s.clone())
            })
            .unwrap_or_else(|| Sharding::replicated(rank, mesh.axes.len()));
        o.attrs
            .insert("nns.layout".into(), layout_attr(&want, mesh));
    }
    Ok(changed)
}

/// An op of another dialect than ours (`arith`, `tensor`, a user's).
pub fn is_foreign(op: &str) -> bool {
    !op.starts_with("dnn.") && !op.starts_with("nns.")
}

#[cfg(test)]
mod tests {
    use super::*;
    use nnscaler_dialects::context::IrContext;
    use nnscaler_dialects::verify::Meshes;

    /// A broadcast into a new leading dim, read by an op split on it: propagation splits
    /// the broadcast there, and reports that split among the ops' decided binds (which
    /// planners write as directives).
    #[test]
    fn a_new_dim_takes_its_consumers_split() {
        let text = r#"
"nns.mesh"() {sym_name = "world", axes = #nns.axes<dp = 2>} : () -> ()
func.func @lead(%x: tensor<4x6xf32>, %y: tensor<8x4x6xf32> {nns.layout = #nns.layout<@world, dp = D(0)>}) -> tensor<8x4x6xf32> {
  %b = "dnn.broadcast_to"(%x) {shape = array<i64: 8, 4, 6>} : (tensor<4x6xf32>) -> tensor<8x4x6xf32>
  %e = "dnn.exp"(%b) : (tensor<8x4x6xf32>) -> tensor<8x4x6xf32>
  %s = "dnn.add"(%e, %y) : (tensor<8x4x6xf32>, tensor<8x4x6xf32>) -> tensor<8x4x6xf32>
  return %s : tensor<8x4x6xf32>
}
"#;
        let ir = IrContext::new();
        let m = ir.parse(text, "lead.mlir").expect("parses");
        let mut d = Diagnostics::default();
        let mesh = Meshes::collect(&m.as_operation(), &mut d).0[0].clone();
        let g = Graph::all_in(&m).remove(0).expect("a graph");
        let mut remarks = Diagnostics::default();
        let (out, decided) = propagate_lenient(g, &mesh, &mut remarks).expect("propagates");
        let split = |k: usize| decided[k].as_ref().map(|(b, _)| b.clone());
        assert_eq!(split(0), Some(vec![("a".to_string(), vec![0])]));
        assert_eq!(split(1), Some(vec![("*0".to_string(), vec![0])]));
        let layouts = value_layouts(&out, &mesh).expect("layouts");
        let b = out.nodes[0].outputs[0];
        assert_eq!(
            layouts[b].as_ref().map(|l| l.split.clone()),
            Some(vec![vec![0], vec![], vec![]])
        );
    }
}

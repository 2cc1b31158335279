//! The per-op tensor-parallel split search behind `--plan="tp-search ..."`: every forward
//! op's split over mesh axis `tp` (one annotation identifier, or none), every parameter's
//! and data input's layout over `tp`, chosen by Z3 ([`crate::planner::split_problem`]) to minimise
//! the training step's predicted time under the user's constraints and the memory cap.
//!
//! **Choices.** The other axes (`dp`, a micro-batch axis) are planned first as `--plan=dp`
//! plans them, and propagated over the forward: an op's choices keep those binds and add
//! one over `tp` — each identifier its annotation lets split (`Annotation::split_choices`)
//! whose length `tp` divides — or split nothing over `tp` (`R`, written as `R(tp)` in the
//! directive so that nothing is inferred over it). A cross-entropy may also take its
//! logits split on the classes (`vocab`: propagation then makes it vocabulary-parallel).
//! A parameter or data input is replicated over `tp` or split on one dim `tp` divides
//! (that no other axis splits).
//!
//! **Costs** (seconds of the cost model, [`crate::planner::cost`]), per choice: the op's forward
//! and backward on one device's shard, with the collectives inside them
//! (vocabulary-parallel cross-entropy's reductions), measured by compiling the op and its
//! VJP alone (propagation, split, lowering, localization of a scratch function whose
//! operands arrive in the choice's layouts and whose results' gradients arrive in their
//! results' layouts) and predicting every op of the result — which also gives the layout
//! each operand's gradient leaves in and the binds of each backward op; a parameter's
//! choice costs its optimizer update on its shard. Per value: the transition (the
//! collectives `--lower-relayouts` would emit, [`TransitionSearch`]) from its producer's
//! layout to each distinct layout its consumers read it in, once per layout; a parameter
//! gathered for an op is gathered again for its backward; a function result must be
//! replicated; and backward, from each distinct layout its gradient arrives in to the one
//! its producer's backward reads (a partial result's gradient is replicated; a
//! parameter's gradient ends in the parameter's layout). Memory per device: parameters
//! with their gradients and optimizer state, and the activations the backward keeps, on
//! their shards. The sums of reused gradients (one `add` per forward use of a value after
//! the first) are costed on the producer's layout. Not in the objective: the loss's seed
//! and clipping.
//!
//! **Classes.** Layers with the same signature (ops, attributes, shapes and how they
//! connect: a model's repeated blocks) share variables: op `i` of every such layer is one
//! class, and so is its `j`-th parameter, so a 96-layer model is solved as one block plus
//! the ops around the layers. Costs are multiplied by how often they occur.
//!
//! **Writing the plan.** Each forward op gets its choice's directive (with `R(tp)` where
//! it is replicated), each argument its layout, the optimizer state its parameter's. Each
//! backward op of a forward op (autodiff gives them the forward op's location; the VJP
//! rule's ops come in order) gets the binds its scratch compilation gave it, so the
//! compiled backward is the one the objective costed. Where a backward op would still
//! follow a split that does not divide its dimension (a gradient split 8 ways reshaped
//! into 12 heads), it gets `R(tp)` for that axis (lenient propagation decides which). The
//! objective then predicts the compiled per-device program within a few percent
//! (`tools/tests/integration/split_search.rs`).

use crate::layouts::{
    annotation, constraint, directive, layout_attr, replicated_axes, split_directive, value_layouts,
};
use crate::planner::cost::{self, Cluster};
use crate::planner::policies::{plan, Policy};
use crate::rewrite::compact;
use crate::transforms::localize::localize;
use crate::transforms::lower_relayouts::lower;
use crate::transforms::propagate_layouts::{propagate, propagate_lenient, Decided};
use crate::transforms::recompute::{forward_ops, has_backward, layers};
use crate::transforms::split_tensor::split;
use nnscaler_dialects::annotation::{Annotation, Binding, DimKind};
use nnscaler_dialects::diag::{Diagnostics, SrcLoc};
use nnscaler_dialects::graph::{Graph, Node, Output, ValueId};
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::sharding::{
    op_layouts, partial_kind, Binds, Sharding, StepPrice, TransitionSearch,
};
use nnscaler_dialects::types::{AttrValue, Attrs, TensorType};
use nnscaler_dialects::vjp::VjpCtx;
use std::collections::{BTreeMap, HashMap};

mod blocks;
mod choices;

pub(crate) use blocks::blocks;
use blocks::*;
use choices::*;

pub use crate::planner::split_problem::{
    Choice, Class, Impossible, Infeasible, Member, Pick, Problem, Solution, Term,
};

/// The search's inputs besides the step.
#[derive(Clone, Debug)]
pub struct Options<'a> {
    /// The cluster costs are predicted on.
    pub cluster: &'a Cluster,
    /// The mesh axis searched (`tp`).
    pub axis: &'a str,
    /// Bytes each device may use (the mesh's `memory_cap`, else none).
    pub memory_cap: Option<u64>,
    /// Where the cap is written.
    pub cap_loc: SrcLoc,
}

impl<'a> Options<'a> {
    /// The options for `mesh` (its `memory_cap`) on `cluster`, searching `axis`.
    pub fn on(mesh: &Mesh, cluster: &'a Cluster, axis: &'a str) -> Self {
        Options {
            cluster,
            axis,
            memory_cap: mesh.memory_cap.map(|c| c.max(0) as u64),
            cap_loc: SrcLoc::default(),
        }
    }
}

/// A training step prepared for the search: the problem and what applying a solution
/// needs.
#[derive(Debug)]
pub struct Prepared {
    /// The problem.
    pub problem: Problem,
    /// The step with the other axes planned (`--plan=dp` on the same mesh).
    pub base: Graph,
}

fn fail(loc: &SrcLoc, msg: impl Into<String>) -> Diagnostics {
    let mut d = Diagnostics::default();
    d.error(loc, msg);
    d
}

/// `g` with everything its ops' directives and constraints say about mesh axis `axis`
/// left out (the other axes are planned first, as if `axis` were not there).
fn without_axis(g: &Graph, axis: &str) -> Graph {
    let mut g = g.clone();
    for n in &mut g.nodes {
        for key in ["nns.split", "nns.pin", "nns.forbid"] {
            let Some(Ok(s)) = n.attrs.get(key).and_then(AttrValue::split) else {
                continue;
            };
            let mut s = std::sync::Arc::unwrap_or_clone(s);
            s.binds.retain(|(_, axes)| !axes.iter().any(|a| a == axis));
            s.replicated.retain(|a| a != axis);
            if s.binds.is_empty() && s.replicated.is_empty() {
                n.attrs.remove(key);
            } else {
                n.attrs
                    .insert(key.into(), AttrValue::Split(std::sync::Arc::new(s)));
            }
        }
    }
    g
}

/// Per value: whether it carries a gradient (float, and depends on a parameter).
fn needs_grad(g: &Graph) -> Vec<bool> {
    let mut dep = vec![false; g.values.len()];
    for a in g.args.iter().filter(|a| a.is_param()) {
        dep[a.value] = g.values[a.value].elem.is_float();
    }
    for n in &g.nodes {
        if n.inputs.iter().any(|&v| dep[v]) {
            for &o in &n.outputs {
                dep[o] = g.values[o].elem.is_float();
            }
        }
    }
    dep
}

/// `s` with every partial axis cleared: the layout a partial result's gradient is read in
/// (the gradient of a sum is each part's gradient).
fn grad_layout(s: &Sharding) -> Sharding {
    let mut s = s.clone();
    s.partial.iter_mut().for_each(|p| *p = None);
    s
}

/// Seconds of the collectives taking a `shape` tensor from `from` to `to`, as
/// `--lower-relayouts cluster=...` would emit them (the path `ts`, priced by `price`,
/// finds), each priced as [`cost::predict`] prices the op it becomes
/// ([`cost::relayout_price`]); `None` when there is no way.
fn transition_seconds(
    (ts, price): (&mut TransitionSearch, &StepPrice),
    mesh: &Mesh,
    ty: &TensorType,
    from: &Sharding,
    to: &Sharding,
) -> Option<f64> {
    // A micro-batch axis is time, not devices: what is split or partial over it stays so
    // (the schedule passes run the pieces one after another and accumulate the partial).
    let mut to = to.clone();
    for (a, axis) in mesh.axes.iter().enumerate() {
        if !axis.microbatches {
            continue;
        }
        to.partial[a] = from.partial[a];
        for d in 0..to.split.len() {
            to.split[d].retain(|&x| x != a);
        }
        for (d, axes) in from.split.iter().enumerate() {
            if let (Some(p), Some(t)) = (axes.iter().position(|&x| x == a), to.split.get_mut(d)) {
                t.insert(p.min(t.len()), a);
            }
        }
    }
    let to = &to;
    if from == to {
        return Some(0.0);
    }
    let sizes: Vec<i64> = mesh.axes.iter().map(|a| a.size).collect();
    let t = ts.find(from, to, &ty.shape, ty.elem, &sizes)?;
    let mut s = from.clone();
    let mut secs = 0.0;
    let local = |s: &Sharding| {
        s.local_shape(&ty.shape, &sizes)
            .iter()
            .map(|&d| d as f64)
            .product::<f64>()
            * ty.elem.bytes() as f64
    };
    for step in &t.steps {
        let next = step.apply(&s);
        secs += price(step, local(&s), local(&next));
        s = next;
    }
    Some(secs)
}

/// Attributes of a node without the planner's (`nns.*`).
fn own_attrs(n: &Node) -> Attrs {
    n.attrs
        .iter()
        .filter(|(k, _)| !k.starts_with("nns."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// What compiling a forward op and its backward alone under a choice gives.
#[derive(Clone, Debug, Default)]
struct Scratch {
    /// Seconds of the forward and the backward (collectives inside them included).
    seconds: f64,
    /// Per operand, the layout its gradient leaves in.
    grads: Vec<Option<Sharding>>,
    /// Per operand, whether the backward reads it.
    reread: Vec<bool>,
    /// The backward's ops in order (the VJP rule's), each with the binds propagation gave
    /// it and the axes left replicated.
    backward: Vec<(String, Option<Decided>)>,
}

/// Compiles forward op `n` (and its backward, when `backward`) alone under a choice: its
/// operands arrive in `inputs`, its results' gradients in their `outputs` layouts (see
/// [`Scratch`]).
#[expect(
    clippy::too_many_arguments,
    reason = "one scratch compilation's inputs"
)]
fn scratch_costs(
    g: &Graph,
    n: &Node,
    needs: &[bool],
    inputs: &[Option<Sharding>],
    outputs: &[Sharding],
    directive: Option<&AttrValue>,
    mesh: &Mesh,
    cluster: &Cluster,
    backward: bool,
) -> Result<Scratch, String> {
    let run = |with_vjp: bool| -> Result<Scratch, String> {
        let mut s = Graph {
            name: "scratch".into(),
            loc: n.loc.clone(),
            user_ops: g.user_ops.clone(),
            ..Graph::default()
        };
        let mut args = Vec::new();
        for (i, &v) in n.inputs.iter().enumerate() {
            let mut attrs = Attrs::new();
            if let Some(l) = &inputs[i] {
                attrs.insert("nns.layout".into(), layout_attr(l, mesh));
            }
            args.push(s.add_arg(g.values[v].clone(), attrs));
        }
        let mut node = n.clone();
        node.attrs = own_attrs(n);
        if let Some(d) = directive {
            node.attrs.insert("nns.split".into(), d.clone());
        }
        node.inputs = args.clone();
        node.outputs = n
            .outputs
            .iter()
            .map(|&o| s.new_value(g.values[o].clone()))
            .collect();
        node.origin = None;
        s.nodes.push(node.clone());
        let mut results: Vec<ValueId> = node.outputs.clone();
        let mut dxs: Vec<Option<ValueId>> = vec![None; n.inputs.len()];
        if with_vjp {
            let rule = nnscaler_dialects::dnn::vjp_rule(&n.op)
                .ok_or_else(|| format!("'{}' has no VJP rule", n.op))?;
            let dys: Vec<Option<ValueId>> = node
                .outputs
                .iter()
                .zip(outputs)
                .map(|(&o, l)| {
                    if !s.values[o].elem.is_float() {
                        return None;
                    }
                    let mut attrs = Attrs::new();
                    attrs.insert("nns.layout".into(), layout_attr(&grad_layout(l), mesh));
                    Some(s.add_arg(s.values[o].clone(), attrs))
                })
                .collect();
            let mut ctx = VjpCtx {
                g: &mut s,
                node: (&node).into(),
                dys,
                needs: needs.to_vec(),
            };
            let got = rule(&mut ctx)?;
            for (i, dx) in got.into_iter().enumerate() {
                if needs[i] {
                    dxs[i] = dx;
                    results.extend(dx);
                }
            }
        }
        s.outputs = results
            .iter()
            .map(|&v| Output {
                value: v,
                attrs: Attrs::new(),
            })
            .collect();
        let text = |d: Diagnostics| {
            d.0.first()
                .map_or("it does not compile".into(), |e| e.message.clone())
        };
        // Which operands the backward reads.
        let reread: Vec<bool> = args
            .iter()
            .map(|a| s.nodes[1..].iter().any(|m| m.inputs.contains(a)))
            .collect();
        let ops: Vec<String> = s.nodes[1..].iter().map(|m| m.op.to_string()).collect();
        let mut remarks = Diagnostics::default();
        let (mut p, decided) = propagate_lenient(s, mesh, &mut remarks).map_err(text)?;
        let backward: Vec<(String, Option<Decided>)> =
            ops.into_iter().zip(decided.into_iter().skip(1)).collect();
        // Results stay where they are made: no relayout at the end.
        let laid = value_layouts(&p, mesh).map_err(text)?;
        for o in &mut p.outputs {
            if let Some(l) = &laid[o.value] {
                o.attrs.insert("nns.layout".into(), layout_attr(l, mesh));
            }
        }
        let grads: Vec<Option<Sharding>> = dxs
            .iter()
            .map(|dx| dx.and_then(|v| laid[v].clone()))
            .collect();
        let p = split(p, mesh).map_err(text)?;
        let mut ts = TransitionSearch::priced(Vec::new(), cost::relayout_price(cluster, mesh));
        let p = lower(p, mesh, &mut ts).map_err(text)?;
        let p = localize(compact(p), mesh).map_err(text)?;
        let seconds = p
            .nodes
            .iter()
            .filter_map(|m| cost::node_cost(&p, m, cluster, Some(mesh)))
            .map(|c| c.seconds)
            .sum();
        Ok(Scratch {
            seconds,
            grads,
            reread,
            backward,
        })
    };
    if !backward || !needs.iter().any(|&b| b) {
        let mut f = run(false)?;
        f.grads = vec![None; n.inputs.len()];
        f.reread = vec![false; n.inputs.len()];
        return Ok(f);
    }
    run(true)
}

/// The layouts of a forward op under a mirror rule, for ops the scratch compilation cannot
/// take (user ops): each operand's gradient is in its layout, partial over the axes a
/// spatial identifier it lacks is split on.
fn mirror_grads(
    anno: &Annotation,
    binding: &Binding,
    binds: &Binds,
    inputs: &[Option<Sharding>],
) -> Vec<Option<Sharding>> {
    let choices = anno.split_choices(binding);
    inputs
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let mut l = l.clone()?;
            for (id, axes) in binds {
                let Some(c) = choices.iter().find(|c| &c.id == id) else {
                    continue;
                };
                let has = c.positions.iter().any(|p| !p.output && p.tensor == i);
                if !has && c.kind == DimKind::Spatial {
                    for &a in axes {
                        l.partial[a] = Some(nnscaler_dialects::nns::Reduce::Sum);
                    }
                }
            }
            Some(l)
        })
        .collect()
}

/// The predicted seconds of node `n` of `g` with each value's type replaced by `local`.
fn local_node_cost(
    g: &Graph,
    n: &Node,
    local: &dyn Fn(ValueId) -> TensorType,
    cluster: &Cluster,
) -> f64 {
    let mut s = Graph {
        user_ops: g.user_ops.clone(),
        ..Graph::default()
    };
    let mut node = n.clone();
    node.inputs = n.inputs.iter().map(|&v| s.new_value(local(v))).collect();
    node.outputs = n.outputs.iter().map(|&v| s.new_value(local(v))).collect();
    cost::node_cost(&s, &node, cluster, None).map_or(0.0, |c| c.seconds)
}

/// Where a value comes from, for layer signatures.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Ref {
    /// Result `r` of the layer's op `i`.
    Local(usize, usize),
    /// The layer's `j`-th parameter (of this type).
    Param(usize, TensorType),
    /// From outside the layer (this type; an argument by index).
    Outside(TensorType, Option<usize>),
}

/// A forward op's part of its layer's signature.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct OpSig {
    op: String,
    attrs: String,
    inputs: Vec<Ref>,
    outputs: Vec<TensorType>,
}

/// What every part of the preparation reads: the step, the mesh and the step's structure.
struct Facts<'a> {
    g: &'a Graph,
    mesh: &'a Mesh,
    cluster: &'a Cluster,
    /// The searched axis (index) and its size.
    axis: usize,
    tp: i64,
    /// The mesh's axis sizes.
    sizes: Vec<i64>,
    /// Whether the step has a backward, which ops are forward, which values carry a
    /// gradient, each forward op's layer.
    backward: bool,
    fwd: Vec<bool>,
    grad: Vec<bool>,
    layer: Vec<Option<String>>,
    /// Each value's users (op, operand).
    users: Vec<Vec<(usize, usize)>>,
}

impl<'a> Facts<'a> {
    fn new(g: &'a Graph, mesh: &'a Mesh, cluster: &'a Cluster, axis: usize) -> Self {
        let backward = has_backward(g);
        let fwd = if backward {
            forward_ops(g)
        } else {
            vec![true; g.nodes.len()]
        };
        let mut users: Vec<Vec<(usize, usize)>> = vec![Vec::new(); g.values.len()];
        for (k, n) in g.nodes.iter().enumerate() {
            for (i, &v) in n.inputs.iter().enumerate() {
                users[v].push((k, i));
            }
        }
        Facts {
            g,
            mesh,
            cluster,
            axis,
            tp: mesh.axes[axis].size,
            sizes: mesh.axes.iter().map(|a| a.size).collect(),
            backward,
            grad: needs_grad(g),
            layer: layers(g, &fwd),
            fwd,
            users,
        }
    }

    /// Bytes of one device's share of a `ty` tensor laid out as `s`.
    fn local_bytes(&self, ty: &TensorType, s: &Sharding) -> u64 {
        s.local_shape(&ty.shape, &self.sizes)
            .iter()
            .map(|&d| d.max(0) as u64)
            .product::<u64>()
            .saturating_mul(ty.elem.bytes())
    }

    /// Seconds of the sums autodiff makes of value `v`'s gradient: one `add` per forward
    /// use after the first (a residual stream, a tied embedding), on the shard of
    /// `layout`, the layout `v` is made in.
    fn grad_sums(&self, v: ValueId, layout: &Sharding) -> f64 {
        if !self.backward || !self.grad[v] {
            return 0.0;
        }
        let uses = self.users[v]
            .iter()
            .filter(|&&(k, _)| {
                self.fwd[k]
                    && !self.g.nodes[k]
                        .op
                        .spec()
                        .is_some_and(|s| s.traits.optimizer)
            })
            .count();
        if uses < 2 {
            return 0.0;
        }
        let ty = &self.g.values[v];
        let elems: i64 = layout.local_shape(&ty.shape, &self.sizes).iter().product();
        let (elems, bytes) = (
            elems.max(0) as f64,
            elems.max(0) as f64 * ty.elem.bytes() as f64,
        );
        // Two operands read, one result written.
        let add = self
            .cluster
            .device
            .vector_op_time("dnn.add", elems, 3.0 * bytes);
        (uses - 1) as f64 * add
    }

    /// Whether the backward keeps value `v` (a non-forward op reads it).
    fn saved(&self, v: ValueId) -> bool {
        self.users[v].iter().any(|&(k, _)| !self.fwd[k])
    }

    /// An op's name for messages: `'dnn.linear' of h.3`.
    fn op_name(&self, k: usize) -> String {
        let n = &self.g.nodes[k];
        match &self.layer[k] {
            Some(l) => format!("'{}' of {l}", n.op),
            None => format!("'{}'", n.op),
        }
    }

    /// An argument's name for messages.
    fn arg_name(&self, a: usize) -> String {
        self.g.args[a]
            .name()
            .map_or(format!("argument {a}"), |n| format!("'{n}'"))
    }

    fn error(&self, n: &Node, e: impl std::fmt::Display) -> Diagnostics {
        fail(&n.loc, format!("plan: tp-search: '{}': {e}", n.op))
    }
}

/// The other axes planned as `--plan=dp` plans them and propagated over the forward
/// (without what the ops' directives say about the searched axis): per op of `base` its
/// propagated node (forward ops only), and every value's layout.
type DataParallel = (Graph, Vec<Option<usize>>, Vec<Option<Sharding>>);

fn data_parallel(f: &Facts<'_>, base: &Graph) -> Result<DataParallel, Diagnostics> {
    let g = f.g;
    let mut forward = without_axis(base, &f.mesh.axes[f.axis].name);
    let kept: Vec<usize> = (0..g.nodes.len()).filter(|&k| f.fwd[k]).collect();
    forward.nodes = kept.iter().map(|&k| forward.nodes[k].clone()).collect();
    // Its results: those the forward makes (the loss).
    let mut made = vec![false; g.values.len()];
    for a in &g.args {
        made[a.value] = true;
    }
    for n in &forward.nodes {
        for &o in &n.outputs {
            made[o] = true;
        }
    }
    forward.outputs.retain(|o| made[o.value]);
    let mut remarks = Diagnostics::default();
    let pre = propagate(forward, f.mesh, &mut remarks)?;
    if pre.nodes.len() != kept.len() {
        return Err(fail(
            &g.loc,
            "plan: tp-search: planning the data-parallel axes rewrote ops; plan them first",
        ));
    }
    let mut pre_node: Vec<Option<usize>> = vec![None; g.nodes.len()];
    for (j, &k) in kept.iter().enumerate() {
        pre_node[k] = Some(j);
    }
    let layouts = value_layouts(&pre, f.mesh)?;
    Ok((pre, pre_node, layouts))
}

/// The cost terms of the values between classes: per value, the transition from its
/// producer's layout to each distinct layout its consumers read it in (a parameter
/// gathered for an op is gathered again for the op's backward), a function result's to
/// replicated, and its gradient's from each distinct layout it arrives in to the one its
/// producer's backward reads. Values that flow alike (same producer class and result,
/// same consumer classes) are costed once and counted. Also the combinations with no
/// transition between their layouts.
fn flow_terms(
    f: &Facts<'_>,
    classes: &[Class],
    class_of: &HashMap<Member, usize>,
) -> (Vec<Term>, Vec<Impossible>) {
    let (g, mesh) = (f.g, f.mesh);
    let fixed: Vec<usize> = mesh
        .axes
        .iter()
        .enumerate()
        .filter(|(_, a)| a.microbatches)
        .map(|(i, _)| i)
        .collect();
    // Paths as `--lower-relayouts cluster=...` takes them, priced as `predict` prices the
    // ops they become.
    let price = cost::relayout_price(f.cluster, mesh);
    let mut ts = TransitionSearch::priced(fixed, price.clone());
    let mut terms: Vec<Term> = Vec::new();
    let mut impossible = Vec::new();
    // (producer class, result, consumers (class, operand), a function result)
    type Key = (usize, usize, Vec<(usize, usize)>, bool);
    let mut flows: BTreeMap<Key, (ValueId, u64)> = BTreeMap::new();
    let mut values: Vec<(ValueId, usize, usize)> = Vec::new();
    for (a, arg) in g.args.iter().enumerate() {
        if let Some(&c) = class_of.get(&Member::Arg(a)) {
            values.push((arg.value, c, 0));
        }
    }
    for (k, n) in g.nodes.iter().enumerate() {
        if let Some(&c) = class_of.get(&Member::Op(k)) {
            for (r, &v) in n.outputs.iter().enumerate() {
                values.push((v, c, r));
            }
        }
    }
    let outputs: Vec<ValueId> = g
        .outputs
        .iter()
        .filter(|o| {
            !o.name()
                .is_some_and(|n| n.starts_with("grad.") || n.starts_with("next."))
        })
        .map(|o| o.value)
        .collect();
    for (v, c, r) in values {
        let mut consumers: Vec<(usize, usize)> = f.users[v]
            .iter()
            .filter(|&&(k, _)| f.fwd[k])
            .filter_map(|&(k, i)| class_of.get(&Member::Op(k)).map(|&cc| (cc, i)))
            .collect();
        consumers.sort_unstable();
        let out = outputs.contains(&v);
        if consumers.is_empty() && !out {
            continue;
        }
        flows.entry((c, r, consumers, out)).or_insert((v, 0)).1 += 1;
    }
    for ((p, r, consumers, out), (v, count)) in flows {
        let ty = g.values[v].clone();
        let m = count as f64;
        let is_param = matches!(classes[p].members[0], Member::Arg(a) if g.args[a].is_param());
        let carries_grad = f.backward && f.grad[v];
        // (layout, the picks that read it, those whose backward reads it again)
        let mut targets: Vec<(Sharding, Vec<Pick>, Vec<Pick>)> = Vec::new();
        // (layout, the picks whose backward leaves the gradient in it)
        let mut grads: Vec<(Sharding, Vec<Pick>)> = Vec::new();
        for &(cc, i) in &consumers {
            for (k, ch) in classes[cc].choices.iter().enumerate() {
                if let Some(Some(t)) = ch.inputs.get(i) {
                    let reread = ch.reread.get(i).copied().unwrap_or(false);
                    match targets.iter_mut().find(|(s, _, _)| s == t) {
                        Some((_, when, again)) => {
                            when.push((cc, k));
                            if reread {
                                again.push((cc, k));
                            }
                        }
                        None => targets.push((
                            t.clone(),
                            vec![(cc, k)],
                            if reread { vec![(cc, k)] } else { Vec::new() },
                        )),
                    }
                }
                if carries_grad {
                    if let Some(Some(gl)) = ch.grads.get(i) {
                        match grads.iter_mut().find(|(s, _)| s == gl) {
                            Some((_, when)) => when.push((cc, k)),
                            None => grads.push((gl.clone(), vec![(cc, k)])),
                        }
                    }
                }
            }
        }
        let mut cost = |choice: usize, when: &[Pick], from: &Sharding, to: &Sharding| {
            match transition_seconds((&mut ts, &price), mesh, &ty, from, to) {
                Some(s) if s > 0.0 => terms.push(Term {
                    class: p,
                    choice,
                    when: when.to_vec(),
                    seconds: s * m,
                }),
                Some(_) => {}
                None => impossible.push((p, choice, when.to_vec())),
            }
        };
        for (o_idx, ch) in classes[p].choices.iter().enumerate() {
            let Some(from) = ch.outputs.get(r) else {
                continue;
            };
            for (t, when, again) in &targets {
                cost(o_idx, when, from, t);
                if is_param && !again.is_empty() {
                    cost(o_idx, again, from, t);
                }
            }
            if out {
                let want = Sharding::replicated(ty.rank(), mesh.axes.len());
                cost(o_idx, &[], from, &want);
            }
            if carries_grad {
                // The layout the producer's backward reads the gradient in (a parameter's
                // gradient ends in the parameter's layout).
                let want = if is_param {
                    from.clone()
                } else {
                    grad_layout(from)
                };
                for (gl, when) in &grads {
                    cost(o_idx, when, gl, &want);
                }
            }
        }
    }
    (terms, impossible)
}

/// Prepares the search on training step `g` (single device, global shapes) over `mesh`.
pub fn prepare(g: &Graph, mesh: &Mesh, o: &Options<'_>) -> Result<Prepared, Diagnostics> {
    Ok(prepare_with(g, mesh, o, None)?.expect("a full problem is always prepared"))
}

/// [`prepare`], each class given only the choice `only` names for it (by label, as
/// [`Problem::labels`] gives them) when `only` is given: a problem of one selection,
/// without the other choices' scratch compilations and transitions. `None` when `only`
/// does not fit: another number of classes, a class without that choice, or a user
/// constraint the choice breaks.
fn prepare_with(
    g: &Graph,
    mesh: &Mesh,
    o: &Options<'_>,
    only: Option<&[String]>,
) -> Result<Option<Prepared>, Diagnostics> {
    let axis = mesh
        .axes
        .iter()
        .position(|a| a.name == o.axis)
        .ok_or_else(|| {
            fail(
                &g.loc,
                format!(
                    "plan: tp-search needs mesh axis '{}', which '@{}' lacks",
                    o.axis, mesh.name
                ),
            )
        })?;
    let f = Facts::new(g, mesh, o.cluster, axis);
    let base = plan(g.clone(), Policy::Dp, mesh)?;
    let (pre, pre_node, pre_layouts) = data_parallel(&f, &base)?;
    let (mut classes, class_of) = classes(&f);
    if only.is_some_and(|l| l.len() != classes.len()) {
        return Ok(None);
    }
    for (c, class) in classes.iter_mut().enumerate() {
        let label = only.map(|l| l[c].as_str());
        class.choices = match class.members[0] {
            Member::Arg(a) => {
                let v = base.args[a].value;
                let here = pre_layouts[v]
                    .clone()
                    .unwrap_or_else(|| Sharding::replicated(g.values[v].rank(), mesh.axes.len()));
                let mut choices = arg_choices(&f, &base.args[a], here);
                if let Some(label) = label {
                    choices.retain(|ch| ch.label == label);
                }
                choices
            }
            Member::Op(k) => match (pre_node[k], label) {
                (Some(j), _) => op_choices(&f, k, &pre.nodes[j], label)?,
                // Nothing to select from: solved instead.
                (None, Some(_)) => return Ok(None),
                (None, None) => continue,
            },
        };
        if label.is_some() && class.choices.len() != 1 {
            return Ok(None);
        }
    }
    for class in &mut classes {
        class.constraint = match (user_constraint(&f, class), only) {
            (Ok(c), _) => c,
            // The one choice breaks the constraint.
            (Err(_), Some(_)) => return Ok(None),
            (Err(e), None) => return Err(e),
        };
    }
    let (terms, impossible) = flow_terms(&f, &classes, &class_of);
    let cap = o.memory_cap.map(|c| {
        (
            c,
            format!("the memory_cap of {c} bytes per device on @{}", mesh.name),
        )
    });
    Ok(Some(Prepared {
        problem: Problem {
            classes,
            terms,
            impossible,
            cap,
            cap_loc: o.cap_loc.clone(),
        },
        base,
    }))
}

impl Prepared {
    /// Writes a solution into the base step: each op's directive, each argument's layout.
    pub fn apply(&self, sol: &Solution, mesh: &Mesh, axis: &str) -> Graph {
        let a: Vec<usize> = mesh
            .axes
            .iter()
            .position(|x| x.name == axis)
            .into_iter()
            .collect();
        let mut g = self.base.clone();
        // The backward ops of each forward op: autodiff gives them its location (its VJP
        // rule's ops in order, then the sums of reused gradients).
        let fwd = if has_backward(&g) {
            forward_ops(&g)
        } else {
            vec![true; g.nodes.len()]
        };
        let mut forward_at: HashMap<SrcLoc, usize> = HashMap::new();
        let mut backward_at: HashMap<SrcLoc, Vec<usize>> = HashMap::new();
        for (k, n) in g.nodes.iter().enumerate() {
            if n.loc.line == 0 {
                continue;
            }
            if fwd[k] {
                *forward_at.entry(n.loc.clone()).or_default() += 1;
            } else if !n.attrs.contains_key("nns.recompute")
                && !n.op.spec().is_some_and(|s| s.traits.optimizer)
            {
                backward_at.entry(n.loc.clone()).or_default().push(k);
            }
        }
        for (class, &k) in self.problem.classes.iter().zip(&sol.choice) {
            let ch = &class.choices[k];
            for m in &class.members {
                match *m {
                    Member::Op(n) => {
                        // An op without an annotation has no directive to take.
                        if annotation(&g, &g.nodes[n]).is_err() {
                            continue;
                        }
                        let closed: &[usize] = if ch.closed { &a } else { &[] };
                        match split_directive(&ch.binds, closed, mesh) {
                            Some(d) => g.nodes[n].attrs.insert("nns.split".into(), d),
                            None => g.nodes[n].attrs.remove("nns.split"),
                        };
                        // Its backward as the choice compiled it alone.
                        let loc = g.nodes[n].loc.clone();
                        let Some(ops) = backward_at.get(&loc) else {
                            continue;
                        };
                        let same = forward_at.get(&loc) == Some(&1)
                            && ops.len() >= ch.backward.len()
                            && ops
                                .iter()
                                .zip(&ch.backward)
                                .all(|(&b, (op, _))| g.nodes[b].op == *op);
                        if !same {
                            continue;
                        }
                        for (&b, (_, d)) in ops.iter().zip(&ch.backward) {
                            if let Some((binds, closed)) = d {
                                match split_directive(binds, closed, mesh) {
                                    Some(d) => g.nodes[b].attrs.insert("nns.split".into(), d),
                                    None => g.nodes[b].attrs.remove("nns.split"),
                                };
                            }
                        }
                    }
                    Member::Arg(i) => {
                        if let Some(l) = ch.outputs.first() {
                            if ch.label != "R" || g.args[i].attrs.contains_key("nns.layout") {
                                g.args[i]
                                    .attrs
                                    .insert("nns.layout".into(), layout_attr(l, mesh));
                            }
                        }
                    }
                }
            }
        }
        g
    }

    /// One line per class that splits over the axis: what it chose.
    pub fn describe(&self, sol: &Solution) -> Vec<String> {
        self.problem
            .classes
            .iter()
            .zip(&sol.choice)
            .filter(|(c, &k)| c.choices[k].label != "R")
            .map(|(c, &k)| {
                let n = c.members.len();
                format!(
                    "{} -> {}{}",
                    c.name,
                    c.choices[k].label,
                    if n > 1 {
                        format!(" (x{n})")
                    } else {
                        String::new()
                    }
                )
            })
            .collect()
    }
}

/// The infeasibility as located diagnostics: the error at the first constraint, a note at
/// each other.
pub fn conflict_diagnostics(e: &Infeasible, at: &SrcLoc, axis: &str) -> Diagnostics {
    let mut d = Diagnostics::default();
    match e {
        Infeasible::Unknown(why) => d.error(at, format!("plan: tp-search: Z3 gave up: {why}")),
        Infeasible::Conflict(named, _) if named.is_empty() => d.error(
            at,
            format!("plan: tp-search: no split over {axis} can be compiled"),
        ),
        Infeasible::Conflict(named, least) => {
            let list: Vec<&str> = named.iter().map(|(w, _)| w.as_str()).collect();
            let first = named
                .iter()
                .find(|(_, l)| l.line > 0)
                .map_or(at.clone(), |(_, l)| l.clone());
            let least = least
                .map(|b| format!(" (the others allow no fewer than {b} bytes per device)"))
                .unwrap_or_default();
            d.error(
                &first,
                format!(
                    "plan: tp-search: these constraints cannot hold together: {}{least}",
                    list.join("; ")
                ),
            );
            for (w, l) in named.iter().filter(|(_, l)| l.line > 0 && *l != first) {
                d.note(l, format!("in conflict: {w}"));
            }
        }
    }
    d
}

/// Plans `g` over `mesh`: `--plan=dp` on the other axes, then the searched splits over
/// `axis`. Returns the planned step and the solution's description.
pub fn tp_search(
    g: Graph,
    mesh: &Mesh,
    cluster: &Cluster,
    axis: &str,
) -> Result<Searched, Diagnostics> {
    tp_search_reusing(g, mesh, cluster, axis, None)
}

/// [`tp_search`], taking the choices `reuse` names (a [`Searched::labels`] of the same
/// step on another mesh of the same `axis` size) instead of solving, when each class has
/// that choice and the selection keeps the constraints; else it solves. A reused
/// selection is prepared alone (the other choices are neither compiled nor costed), so
/// the result's problem then holds one choice per class.
pub fn tp_search_reusing(
    g: Graph,
    mesh: &Mesh,
    cluster: &Cluster,
    axis: &str,
    reuse: Option<&[String]>,
) -> Result<Searched, Diagnostics> {
    let o = Options::on(mesh, cluster, axis);
    // The reused selection, as a problem of its choices alone, when it holds.
    let reused = match reuse {
        Some(labels) => prepare_with(&g, mesh, &o, Some(labels))?.and_then(|p| {
            let choice = vec![0; p.problem.classes.len()];
            p.problem.allows(&choice).then(|| {
                let solution = Solution {
                    seconds: p.problem.evaluate(&choice),
                    memory: p.problem.memory(&choice),
                    choice,
                };
                (p, solution)
            })
        }),
        None => None,
    };
    let (prepared, solution) = match reused {
        Some(found) => found,
        None => {
            let prepared = prepare(&g, mesh, &o)?;
            let solution = prepared
                .problem
                .solve()
                .map_err(|e| conflict_diagnostics(&e, &g.loc, axis))?;
            (prepared, solution)
        }
    };
    let mut planned = prepared.apply(&solution, mesh, axis);
    crate::planner::policies::state_layouts(&mut planned);
    let propagated = backward_directives(&mut planned, mesh)?;
    Ok(Searched {
        planned,
        propagated,
        prepared,
        solution,
    })
}

impl Searched {
    /// The choice of each class by label (for [`tp_search_reusing`]).
    pub fn labels(&self) -> Vec<String> {
        self.prepared.problem.labels(&self.solution.choice)
    }
}

/// The choice of each class by label (see [`Searched::labels`]) of the search on `g`
/// over `mesh`, without writing the plan.
pub fn solve_labels(
    g: &Graph,
    mesh: &Mesh,
    cluster: &Cluster,
    axis: &str,
) -> Result<Vec<String>, Diagnostics> {
    let o = Options::on(mesh, cluster, axis);
    let prepared = prepare(g, mesh, &o)?;
    let sol = prepared
        .problem
        .solve()
        .map_err(|e| conflict_diagnostics(&e, &g.loc, axis))?;
    Ok(prepared.problem.labels(&sol.choice))
}

/// What [`tp_search`] found.
#[derive(Debug)]
pub struct Searched {
    /// The step with the plan's directives: what `--plan` writes.
    pub planned: Graph,
    /// `planned` propagated (what `--propagate-layouts` makes of it), when the search
    /// propagated it already.
    pub propagated: Option<Graph>,
    /// The problem.
    pub prepared: Prepared,
    /// Z3's solution.
    pub solution: Solution,
}

/// Backward ops follow their operands' layouts; where a split they would follow does not
/// divide their dimension (a gradient split on 768 / 8 reshaped into 12 heads), they are
/// given a directive replicating them over those axes (`R(tp)`), so propagation gathers
/// the operand instead of refusing the plan. Optimizer ops are left to propagation (ZeRO
/// changes their state's layouts after the plan). Returns the propagated step when every
/// op it replicated got its directive (what `--propagate-layouts` then makes of `g`).
fn backward_directives(g: &mut Graph, mesh: &Mesh) -> Result<Option<Graph>, Diagnostics> {
    if !has_backward(g) {
        return Ok(None);
    }
    let fwd = forward_ops(g);
    let mut remarks = Diagnostics::default();
    let (propagated, decided) = propagate_lenient(g.clone(), mesh, &mut remarks)?;
    let mut complete = true;
    for (k, d) in decided.into_iter().enumerate() {
        let Some((binds, closed)) = d else { continue };
        if closed.is_empty() {
            continue;
        }
        let n = &g.nodes[k];
        let optimizer = n.op.spec().is_some_and(|s| s.traits.optimizer);
        if fwd[k] || optimizer {
            complete = false;
            continue;
        }
        if let Some(d) = split_directive(&binds, &closed, mesh) {
            g.nodes[k].attrs.insert("nns.split".into(), d);
        }
    }
    Ok(complete.then_some(propagated))
}

/// Compiles a planned step for `cluster` (`--propagate-layouts`, `--split-tensor`,
/// `--lower-relayouts cluster=...`, `--localize`): its per-device program.
pub fn compile(planned: Graph, mesh: &Mesh, cluster: &Cluster) -> Result<Graph, Diagnostics> {
    let mut remarks = Diagnostics::default();
    let g = propagate(planned, mesh, &mut remarks)?;
    let g = split(g, mesh)?;
    let mut ts = TransitionSearch::priced(Vec::new(), cost::relayout_price(cluster, mesh));
    let g = lower(g, mesh, &mut ts)?;
    localize(compact(g), mesh)
}

/// [`compile`]d and predicted on `cluster`: what the search's objective estimates. That
/// is without the devices' drift between collectives (`Device::sync_jitter`), which the
/// objective leaves out: a collective's wait depends on the compute since the one before
/// it, an order of ops Z3 does not choose.
pub fn compiled_seconds(
    planned: Graph,
    mesh: &Mesh,
    cluster: &Cluster,
) -> Result<f64, Diagnostics> {
    let local = compile(planned, mesh, cluster)?;
    let mut c = cluster.for_program(&local).into_owned();
    c.device.sync_jitter = 0.0;
    Ok(cost::predict(&local, &c, Some(mesh)).seconds())
}

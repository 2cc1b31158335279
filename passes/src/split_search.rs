//! The per-op tensor-parallel split search behind `--plan="tp-search ..."`: every forward
//! op's split over mesh axis `tp` (one annotation identifier, or none), every parameter's
//! and data input's layout over `tp`, chosen by Z3 to minimise the training step's
//! predicted time under the user's constraints and the memory cap.
//!
//! **Choices.** The other axes (`dp`, a micro-batch axis) are planned first as `--plan=dp`
//! plans them, and propagated: an op's choices keep those binds and add one over `tp` —
//! each identifier its annotation lets split (`Annotation::split_choices`) whose length
//! `tp` divides — or split nothing over `tp` (`R`, written as `R(tp)` in the directive so
//! that nothing is inferred over it). A cross-entropy may also take its logits split on
//! the classes (`vocab`: propagation then makes it vocabulary-parallel). A parameter or
//! data input is replicated over `tp` or split on one dim `tp` divides (that no other axis
//! splits).
//!
//! **Costs** (seconds of the cost model, [`crate::cost`]), per choice: the op's forward and
//! backward on one device's shard, with the collectives inside them (vocabulary-parallel
//! cross-entropy's reductions), measured by compiling the op and its VJP alone
//! (propagation, split, lowering, localization of a scratch function whose operands arrive
//! in the choice's layouts) and predicting every op of the result — which also gives the
//! layout each operand's gradient leaves in; a parameter's choice costs its optimizer
//! update on its shard. Per value: the transition (the collectives `--lower-relayouts`
//! would emit, [`TransitionSearch`]) from its producer's layout to each distinct layout its
//! consumers need, once per layout; a parameter gathered for an op is gathered again for
//! its backward; a function result must be replicated; and backward, from each distinct
//! layout its gradient arrives in to the one its producer's backward reads (a partial
//! result's gradient is replicated; a parameter's gradient ends in the parameter's
//! layout). Memory per device: parameters with their gradients and optimizer state, and
//! the activations the backward keeps, on their shards.
//!
//! **Classes.** Layers with the same signature (ops, attributes, shapes and how they
//! connect: a model's repeated blocks) share variables: op `i` of every such layer is one
//! class, and so is its `j`-th parameter, so a 96-layer model is solved as one block plus
//! the ops around the layers. Costs are multiplied by how often they occur.
//!
//! **Solving.** One Boolean per (class, choice), exactly one per class; a cost term that
//! depends on two classes (a transition between a producer's choice and the layouts its
//! consumers' choices need) gets an auxiliary Boolean implied by them. User constraints —
//! an op's `nns.split` or `nns.pin` binding `tp`, an `nns.forbid` over `tp` — and the
//! memory cap are asserted with tracking literals on a `Solver` first: when they cannot
//! hold together, the unsat core names the ones in conflict. Then `Optimize` minimises the
//! weighted sum (weights in nanoseconds) as soft constraints. [`Problem::evaluate`] computes
//! the same objective for any selection; the tests compare Z3's optimum with brute force.

use crate::cost::{self, Cluster};
use crate::layouts::{
    annotation, constraint, directive, layout_attr, replicated_axes, value_layouts,
};
use crate::localize::localize;
use crate::lower_relayouts::lower;
use crate::plan::{plan, Policy};
use crate::propagate_layouts::{propagate, propagate_lenient, Decided};
use crate::recompute::{forward_ops, has_backward, layers};
use crate::search::compact;
use crate::split_tensor::split;
use nnscaler_dialects::annotation::{Annotation, Binding, DimKind};
use nnscaler_dialects::diag::{Diagnostics, SrcLoc};
use nnscaler_dialects::dnn;
use nnscaler_dialects::graph::{Graph, Node, Output, ValueId};
use nnscaler_dialects::nns::{Mesh, Split};
use nnscaler_dialects::sharding::{
    binds_to_split, op_layouts, partial_kind, Binds, Sharding, TransitionSearch,
};
use nnscaler_dialects::types::{AttrValue, Attrs, TensorType};
use nnscaler_dialects::vjp::VjpCtx;
use std::collections::{BTreeMap, HashMap};
use z3::ast::{Bool, Int};
use z3::{Optimize, SatResult, Solver};

/// One thing a class may do over `tp`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Choice {
    /// `R`, the split identifier (`n`), `vocab`, or for an argument `D(d)`.
    pub label: String,
    /// The op's directive over every axis (ops only).
    pub binds: Binds,
    /// Whether the directive names `R(tp)`.
    pub closed: bool,
    /// Per operand, the layout the op reads it in (`None`: not a tensor operand).
    pub inputs: Vec<Option<Sharding>>,
    /// Per result, its layout (an argument: its own layout).
    pub outputs: Vec<Sharding>,
    /// Per operand, the layout its gradient leaves the op's backward in.
    pub grads: Vec<Option<Sharding>>,
    /// Per operand, whether the op's backward reads it again.
    pub reread: Vec<bool>,
    /// Seconds per occurrence: forward and backward on one device (collectives inside
    /// included); a parameter's optimizer update.
    pub seconds: f64,
    /// Bytes per occurrence that a device keeps: activations saved for the backward, or a
    /// parameter with its gradient and optimizer state.
    pub memory: u64,
    /// The op's backward (its VJP rule's ops, in order) as compiled alone under this
    /// choice: each op's binds and the axes it is replicated over, written as directives
    /// on the step's backward ops so that they follow it.
    pub backward: Vec<(String, Option<Decided>)>,
}

/// What a class stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Member {
    /// A forward op (node index).
    Op(usize),
    /// A function argument (index).
    Arg(usize),
}

/// A set of ops or arguments that take the same choice (one, or the same position in
/// every layer of a signature).
#[derive(Clone, Debug)]
pub struct Class {
    /// Its ops or arguments, in program order.
    pub members: Vec<Member>,
    /// What it may do (index 0 splits nothing over `tp`).
    pub choices: Vec<Choice>,
    /// A user constraint: the choices it allows and what it is (for messages).
    pub constraint: Option<(Vec<bool>, String, SrcLoc)>,
    /// For messages: the op (name and location) or argument.
    pub name: String,
    /// Its first member's location.
    pub loc: SrcLoc,
}

/// A cost term: `seconds` when class `class` takes choice `choice` and (unless `when` is
/// empty) at least one of the (class, choice) pairs in `when` holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Term {
    /// The class.
    pub class: usize,
    /// Its choice.
    pub choice: usize,
    /// The condition.
    pub when: Vec<(usize, usize)>,
    /// Seconds.
    pub seconds: f64,
}

/// The search problem: classes, cost terms, combinations that cannot be compiled, memory.
#[derive(Clone, Debug, Default)]
pub struct Problem {
    /// The classes.
    pub classes: Vec<Class>,
    /// Cost terms that depend on more than one class (unary costs are the choices').
    pub terms: Vec<Term>,
    /// (class, choice, when): combinations with no transition between their layouts.
    pub impossible: Vec<(usize, usize, Vec<(usize, usize)>)>,
    /// Bytes each device may use, and where the cap comes from.
    pub cap: Option<(u64, String)>,
    /// Where the cap is written (the mesh).
    pub cap_loc: SrcLoc,
}

/// Why the search found nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Infeasible {
    /// These constraints (what, where) cannot hold together; when the memory cap is one of
    /// them, the fewest bytes per device the others allow.
    Conflict(Vec<(String, SrcLoc)>, Option<u64>),
    /// Z3 gave up (its reason).
    Unknown(String),
}

/// The solution: a choice per class and its predicted seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct Solution {
    /// The choice of each class.
    pub choice: Vec<usize>,
    /// The objective ([`Problem::evaluate`]).
    pub seconds: f64,
    /// Bytes per device the solution keeps.
    pub memory: u64,
}

impl Problem {
    /// The objective for a selection (one choice per class).
    pub fn evaluate(&self, sel: &[usize]) -> f64 {
        let mut t: f64 = self
            .classes
            .iter()
            .zip(sel)
            .map(|(c, &k)| c.choices[k].seconds * c.members.len() as f64)
            .sum();
        for term in &self.terms {
            if sel[term.class] == term.choice
                && (term.when.is_empty() || term.when.iter().any(|&(c, k)| sel[c] == k))
            {
                t += term.seconds;
            }
        }
        t
    }

    /// Bytes per device of a selection.
    pub fn memory(&self, sel: &[usize]) -> u64 {
        self.classes
            .iter()
            .zip(sel)
            .map(|(c, &k)| c.choices[k].memory * c.members.len() as u64)
            .sum()
    }

    /// Whether a selection may be compiled and respects the constraints and the cap.
    pub fn allows(&self, sel: &[usize]) -> bool {
        let ok_constraints = self.classes.iter().zip(sel).all(|(c, &k)| {
            c.constraint
                .as_ref()
                .is_none_or(|(allowed, _, _)| allowed[k])
        });
        let possible = self.impossible.iter().all(|(c, k, when)| {
            !(sel[*c] == *k && (when.is_empty() || when.iter().any(|&(x, y)| sel[x] == y)))
        });
        let fits = self
            .cap
            .as_ref()
            .is_none_or(|(cap, _)| self.memory(sel) <= *cap);
        ok_constraints && possible && fits
    }

    /// The best selection by enumerating every one (small problems; tests).
    pub fn brute_force(&self) -> Option<Solution> {
        let n = self.classes.len();
        let mut sel = vec![0usize; n];
        let mut best: Option<Solution> = None;
        loop {
            if self.allows(&sel) {
                let s = self.evaluate(&sel);
                if best.as_ref().is_none_or(|b| s < b.seconds - 1e-15) {
                    best = Some(Solution {
                        choice: sel.clone(),
                        seconds: s,
                        memory: self.memory(&sel),
                    });
                }
            }
            // The next selection (odometer).
            let mut i = 0;
            loop {
                if i == n {
                    return best;
                }
                sel[i] += 1;
                if sel[i] < self.classes[i].choices.len() {
                    break;
                }
                sel[i] = 0;
                i += 1;
            }
        }
    }

    /// How many selections there are (saturating).
    pub fn size(&self) -> u128 {
        self.classes
            .iter()
            .fold(1u128, |a, c| a.saturating_mul(c.choices.len() as u128))
    }

    /// The best selection, by Z3 (see the module docs).
    pub fn solve(&self) -> Result<Solution, Infeasible> {
        let x: Vec<Vec<Bool>> = self
            .classes
            .iter()
            .enumerate()
            .map(|(c, class)| {
                (0..class.choices.len())
                    .map(|k| Bool::new_const(format!("x{c}_{k}")))
                    .collect()
            })
            .collect();
        let one_each: Vec<Bool> = x
            .iter()
            .map(|xs| {
                let terms: Vec<(&Bool, i32)> = xs.iter().map(|b| (b, 1)).collect();
                Bool::pb_eq(&terms, 1)
            })
            .collect();
        let any = |when: &[(usize, usize)]| -> Bool {
            let v: Vec<&Bool> = when.iter().map(|&(c, k)| &x[c][k]).collect();
            Bool::or(&v)
        };
        let impossible: Vec<Bool> = self
            .impossible
            .iter()
            .map(|(c, k, when)| {
                if when.is_empty() {
                    x[*c][*k].not()
                } else {
                    Bool::and(&[&x[*c][*k], &any(when)]).not()
                }
            })
            .collect();
        // Tracked: user constraints and the memory cap.
        let mut tracked: Vec<(Bool, (String, SrcLoc))> = Vec::new();
        for (c, class) in self.classes.iter().enumerate() {
            if let Some((allowed, what, loc)) = &class.constraint {
                let ok: Vec<&Bool> = x[c]
                    .iter()
                    .zip(allowed)
                    .filter(|(_, &a)| a)
                    .map(|(b, _)| b)
                    .collect();
                tracked.push((Bool::or(&ok), (what.clone(), loc.clone())));
            }
        }
        let mut terms: Vec<Int> = Vec::new();
        for (c, class) in self.classes.iter().enumerate() {
            for (k, ch) in class.choices.iter().enumerate() {
                let bytes = ch.memory.saturating_mul(class.members.len() as u64);
                if bytes > 0 {
                    terms.push(x[c][k].ite(&Int::from_u64(bytes), &Int::from_u64(0)));
                }
            }
        }
        let memory_sum = if terms.is_empty() {
            Int::from_u64(0)
        } else {
            Int::add(&terms)
        };
        // The cap is tracked last.
        if let Some((cap, what)) = &self.cap {
            tracked.push((
                memory_sum.le(Int::from_u64(*cap)),
                (what.clone(), self.cap_loc.clone()),
            ));
        }
        // Feasibility first, with the constraints tracked.
        let solver = Solver::new();
        for b in one_each.iter().chain(&impossible) {
            solver.assert(b);
        }
        let lits: Vec<Bool> = (0..tracked.len())
            .map(|i| Bool::new_const(format!("constraint{i}")))
            .collect();
        for ((c, _), lit) in tracked.iter().zip(&lits) {
            solver.assert(&lit.implies(c));
        }
        match solver.check_assumptions(&lits) {
            SatResult::Sat => {}
            SatResult::Unsat => {
                let core = solver.get_unsat_core();
                let mut in_core: Vec<bool> = lits.iter().map(|l| core.contains(l)).collect();
                // Z3's core need not be minimal: drop each constraint that the others
                // conflict without.
                for i in 0..lits.len() {
                    if !in_core[i] {
                        continue;
                    }
                    in_core[i] = false;
                    let rest: Vec<Bool> = lits
                        .iter()
                        .zip(&in_core)
                        .filter(|(_, &c)| c)
                        .map(|(l, _)| l.clone())
                        .collect();
                    if solver.check_assumptions(&rest) != SatResult::Unsat {
                        in_core[i] = true;
                    }
                }
                let named = tracked
                    .iter()
                    .zip(&in_core)
                    .filter(|(_, &c)| c)
                    .map(|((_, w), _)| w.clone())
                    .collect();
                // With the cap in the core: the leanest the other constraints allow.
                let capped = self.cap.is_some() && in_core.last() == Some(&true);
                let least = capped.then(|| {
                    let opt = Optimize::new();
                    for b in one_each.iter().chain(&impossible) {
                        opt.assert(b);
                    }
                    for (c, _) in &tracked[..tracked.len() - 1] {
                        opt.assert(c);
                    }
                    opt.minimize(&memory_sum);
                    match opt.check(&[]) {
                        SatResult::Sat => opt
                            .get_model()
                            .and_then(|m| m.eval(&memory_sum, true))
                            .and_then(|v| v.as_u64()),
                        _ => None,
                    }
                });
                return Err(Infeasible::Conflict(named, least.flatten()));
            }
            SatResult::Unknown => {
                return Err(Infeasible::Unknown(
                    solver.get_reason_unknown().unwrap_or_default(),
                ))
            }
        }
        // Then the optimum.
        let opt = Optimize::new();
        for b in one_each.iter().chain(&impossible) {
            opt.assert(b);
        }
        for (c, _) in &tracked {
            opt.assert(c);
        }
        let ns = |s: f64| (s * 1e9).round().max(0.0) as u64;
        // Unary costs relative to the class's cheapest choice (smaller weights).
        for (c, class) in self.classes.iter().enumerate() {
            let each: Vec<f64> = class
                .choices
                .iter()
                .map(|ch| ch.seconds * class.members.len() as f64)
                .collect();
            let least = each.iter().copied().fold(f64::INFINITY, f64::min);
            for (k, s) in each.iter().enumerate() {
                let w = ns(s - least);
                if w > 0 {
                    opt.assert_soft(&x[c][k].not(), w, None);
                }
            }
        }
        // Terms sharing (class, choice, condition) are summed.
        let mut grouped: BTreeMap<(usize, usize, Vec<(usize, usize)>), f64> = BTreeMap::new();
        for t in &self.terms {
            let mut when = t.when.clone();
            when.sort_unstable();
            when.dedup();
            *grouped.entry((t.class, t.choice, when)).or_default() += t.seconds;
        }
        for (i, ((c, k, when), s)) in grouped.iter().enumerate() {
            let w = ns(*s);
            if w == 0 {
                continue;
            }
            if when.is_empty() {
                opt.assert_soft(&x[*c][*k].not(), w, None);
                continue;
            }
            let y = Bool::new_const(format!("y{i}"));
            opt.assert(&Bool::and(&[&x[*c][*k], &any(when)]).implies(&y));
            opt.assert_soft(&y.not(), w, None);
        }
        match opt.check(&[]) {
            SatResult::Sat => {}
            SatResult::Unsat => return Err(Infeasible::Conflict(Vec::new(), None)),
            SatResult::Unknown => {
                return Err(Infeasible::Unknown(
                    opt.get_reason_unknown().unwrap_or_default(),
                ))
            }
        }
        let model = opt
            .get_model()
            .ok_or(Infeasible::Unknown("no model".into()))?;
        let choice: Vec<usize> = x
            .iter()
            .map(|xs| {
                xs.iter()
                    .position(|b| {
                        model
                            .eval(b, true)
                            .and_then(|v| v.as_bool())
                            .unwrap_or(false)
                    })
                    .unwrap_or(0)
            })
            .collect();
        Ok(Solution {
            seconds: self.evaluate(&choice),
            memory: self.memory(&choice),
            choice,
        })
    }
}

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
fn without_axis(g: &Graph, mesh: &Mesh, axis: &str) -> Graph {
    let mut g = g.clone();
    for n in &mut g.nodes {
        for key in ["nns.split", "nns.pin", "nns.forbid"] {
            let Some(AttrValue::Nns { kind, body }) = n.attrs.get(key) else {
                continue;
            };
            let Ok(mut s) = Split::parse(body).map(|s| (kind.clone(), s)) else {
                continue;
            };
            s.1.binds
                .retain(|(_, axes)| !axes.iter().any(|a| a == axis));
            s.1.replicated.retain(|a| a != axis);
            if s.1.binds.is_empty() && s.1.replicated.is_empty() {
                n.attrs.remove(key);
            } else {
                n.attrs.insert(
                    key.into(),
                    AttrValue::Nns {
                        kind: s.0,
                        body: s.1.to_string(),
                    },
                );
            }
        }
    }
    let _ = mesh;
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
/// `--lower-relayouts` would emit them; `None` when there is no way.
fn transition_seconds(
    ts: &mut TransitionSearch,
    cluster: &Cluster,
    mesh: &Mesh,
    ty: &TensorType,
    from: &Sharding,
    to: &Sharding,
) -> Option<f64> {
    if from == to {
        return Some(0.0);
    }
    let sizes: Vec<i64> = mesh.axes.iter().map(|a| a.size).collect();
    let t = ts.find(from, to, &ty.shape, ty.elem.bytes(), &sizes)?;
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
        let axes: Vec<String> = step_axes(step)
            .iter()
            .map(|&a| mesh.axes[a].name.clone())
            .collect();
        secs += cost::collective_seconds(
            cluster,
            mesh,
            step.op_name(),
            &axes,
            local(&s),
            local(&next),
        )
        .unwrap_or(0.0);
        s = next;
    }
    Some(secs)
}

fn step_axes(step: &nnscaler_dialects::sharding::Step) -> Vec<usize> {
    use nnscaler_dialects::sharding::Step;
    match step {
        Step::AllReduce { axes, .. } => axes.clone(),
        Step::ReduceScatter { axis, .. }
        | Step::AllGather { axis, .. }
        | Step::AllToAll { axis, .. }
        | Step::Partition { axis }
        | Step::Slice { axis, .. } => vec![*axis],
    }
}

/// The directive attribute of binds, with `R(axes)` for the `closed` axes; `None` when it
/// says nothing.
fn split_attr(binds: &Binds, closed: &[usize], mesh: &Mesh) -> Option<AttrValue> {
    let mut s: Split = binds_to_split(binds, mesh);
    s.replicated = closed.iter().map(|&a| mesh.axes[a].name.clone()).collect();
    (!s.binds.is_empty() || !s.replicated.is_empty()).then(|| AttrValue::Nns {
        kind: "split".into(),
        body: s.to_string(),
    })
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
            let rule = dnn::spec(&n.op)
                .and_then(|sp| sp.vjp())
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
                node: node.clone(),
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
        let ops: Vec<String> = s.nodes[1..].iter().map(|m| m.op.clone()).collect();
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
        let p = lower(p, mesh, &mut TransitionSearch::new()).map_err(text)?;
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

/// Prepares the search on training step `g` (single device, global shapes) over `mesh`.
pub fn prepare(g: &Graph, mesh: &Mesh, o: &Options<'_>) -> Result<Prepared, Diagnostics> {
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
    let tp = mesh.axes[axis].size;
    // The other axes as --plan=dp plans them, propagated: each op's binds over them.
    let base = plan(g.clone(), Policy::Dp, mesh)?;
    let mut remarks = Diagnostics::default();
    let pre = propagate(
        without_axis(&base, mesh, &mesh.axes[axis].name),
        mesh,
        &mut remarks,
    )?;
    if pre.nodes.len() != base.nodes.len() {
        return Err(fail(
            &g.loc,
            "plan: tp-search: planning the data-parallel axes rewrote ops; plan them first",
        ));
    }
    let pre_layouts = value_layouts(&pre, mesh)?;
    let backward = has_backward(g);
    let fwd = if backward {
        forward_ops(g)
    } else {
        vec![true; g.nodes.len()]
    };
    let grad = needs_grad(g);
    let layer = layers(g, &fwd);
    let sizes: Vec<i64> = mesh.axes.iter().map(|a| a.size).collect();
    let fixed: Vec<usize> = mesh
        .axes
        .iter()
        .enumerate()
        .filter(|(_, a)| a.microbatches)
        .map(|(i, _)| i)
        .collect();
    let mut ts = TransitionSearch::with_fixed_axes(fixed);
    let local_bytes = |ty: &TensorType, s: &Sharding| -> u64 {
        s.local_shape(&ty.shape, &sizes)
            .iter()
            .map(|&d| d.max(0) as u64)
            .product::<u64>()
            .saturating_mul(ty.elem.bytes())
    };
    let mut producer: Vec<Option<usize>> = vec![None; g.values.len()];
    let mut users: Vec<Vec<(usize, usize)>> = vec![Vec::new(); g.values.len()];
    for (k, n) in g.nodes.iter().enumerate() {
        for &v in &n.outputs {
            producer[v] = Some(k);
        }
        for (i, &v) in n.inputs.iter().enumerate() {
            users[v].push((k, i));
        }
    }
    let arg_of: HashMap<ValueId, usize> = g
        .args
        .iter()
        .enumerate()
        .map(|(i, a)| (a.value, i))
        .collect();
    // Values the backward keeps: forward results a non-forward op reads.
    let saved = |v: ValueId| users[v].iter().any(|&(k, _)| !fwd[k]);

    // --- Classes: layers with equal signatures share them.
    let mut layer_ops: Vec<(String, Vec<usize>)> = Vec::new();
    for k in (0..g.nodes.len()).filter(|&k| fwd[k]) {
        if let Some(l) = &layer[k] {
            match layer_ops.iter_mut().find(|(n, _)| n == l) {
                Some((_, ops)) => ops.push(k),
                None => layer_ops.push((l.clone(), vec![k])),
            }
        }
    }
    // A parameter used by one layer only is that layer's.
    let mut param_layers: HashMap<usize, Vec<&str>> = HashMap::new();
    for (name, ops) in &layer_ops {
        for &k in ops {
            for &v in &g.nodes[k].inputs {
                if let Some(&a) = arg_of.get(&v) {
                    if g.args[a].is_param() {
                        let e = param_layers.entry(a).or_default();
                        if !e.contains(&name.as_str()) {
                            e.push(name);
                        }
                    }
                }
            }
        }
    }
    for (k, n) in g.nodes.iter().enumerate() {
        if fwd[k] && layer[k].is_none() {
            for &v in &n.inputs {
                if let Some(&a) = arg_of.get(&v) {
                    param_layers.entry(a).or_default().push("");
                }
            }
        }
    }
    let own_param = |a: usize, l: &str| param_layers.get(&a).is_some_and(|v| v == &[l]);
    let signature = |name: &str, ops: &[usize]| -> (Vec<OpSig>, Vec<usize>) {
        let mut params: Vec<usize> = Vec::new();
        let pos: HashMap<usize, usize> = ops.iter().enumerate().map(|(i, &k)| (k, i)).collect();
        let sig = ops
            .iter()
            .map(|&k| {
                let n = &g.nodes[k];
                let inputs = n
                    .inputs
                    .iter()
                    .map(|&v| {
                        if let Some(p) = producer[v] {
                            if let Some(&i) = pos.get(&p) {
                                let r = g.nodes[p].outputs.iter().position(|&x| x == v);
                                return Ref::Local(i, r.unwrap_or(0));
                            }
                        }
                        match arg_of.get(&v) {
                            Some(&a) if own_param(a, name) => {
                                let j = params.iter().position(|&p| p == a).unwrap_or_else(|| {
                                    params.push(a);
                                    params.len() - 1
                                });
                                Ref::Param(j, g.values[v].clone())
                            }
                            Some(&a) => Ref::Outside(g.values[v].clone(), Some(a)),
                            None => Ref::Outside(g.values[v].clone(), None),
                        }
                    })
                    .collect();
                let attrs: BTreeMap<&String, String> = n
                    .attrs
                    .iter()
                    .filter(|(k, _)| *k != "nns.layouts")
                    .map(|(k, v)| (k, v.to_mlir_text()))
                    .collect();
                OpSig {
                    op: n.op.clone(),
                    attrs: format!("{attrs:?}"),
                    inputs,
                    outputs: n.outputs.iter().map(|&v| g.values[v].clone()).collect(),
                }
            })
            .collect();
        (sig, params)
    };
    let mut classes: Vec<Class> = Vec::new();
    let mut class_of: HashMap<Member, usize> = HashMap::new();
    let mut sigs: Vec<(Vec<OpSig>, Vec<usize>, Vec<usize>)> = Vec::new(); // (sig, op classes, param classes)
    let new_class = |classes: &mut Vec<Class>, m: Member, name: String, loc: SrcLoc| {
        classes.push(Class {
            members: vec![m],
            choices: Vec::new(),
            constraint: None,
            name,
            loc,
        });
        classes.len() - 1
    };
    let op_name = |k: usize| {
        let n = &g.nodes[k];
        match &layer[k] {
            Some(l) => format!("'{}' of {l}", n.op),
            None => format!("'{}'", n.op),
        }
    };
    let arg_name = |a: usize| {
        g.args[a]
            .name()
            .map_or(format!("argument {a}"), |n| format!("'{n}'"))
    };
    for (name, ops) in &layer_ops {
        let (sig, params) = signature(name, ops);
        if let Some((_, op_classes, param_classes)) = sigs
            .iter()
            .find(|(s, _, p)| *s == sig && p.len() == params.len())
        {
            for (&k, &c) in ops.iter().zip(op_classes) {
                classes[c].members.push(Member::Op(k));
                class_of.insert(Member::Op(k), c);
            }
            for (&a, &c) in params.iter().zip(param_classes) {
                classes[c].members.push(Member::Arg(a));
                class_of.insert(Member::Arg(a), c);
            }
            continue;
        }
        let op_classes: Vec<usize> = ops
            .iter()
            .map(|&k| {
                let c = new_class(
                    &mut classes,
                    Member::Op(k),
                    op_name(k),
                    g.nodes[k].loc.clone(),
                );
                class_of.insert(Member::Op(k), c);
                c
            })
            .collect();
        let param_classes: Vec<usize> = params
            .iter()
            .map(|&a| {
                let c = new_class(&mut classes, Member::Arg(a), arg_name(a), g.loc.clone());
                class_of.insert(Member::Arg(a), c);
                c
            })
            .collect();
        sigs.push((sig, op_classes, param_classes));
    }
    for k in (0..g.nodes.len()).filter(|&k| fwd[k]) {
        class_of.entry(Member::Op(k)).or_insert_with(|| {
            new_class(
                &mut classes,
                Member::Op(k),
                op_name(k),
                g.nodes[k].loc.clone(),
            )
        });
    }
    for (a, arg) in g.args.iter().enumerate() {
        let used = users[arg.value].iter().any(|&(k, _)| fwd[k]);
        if used && !arg.attrs.contains_key("nns.state_of") {
            class_of.entry(Member::Arg(a)).or_insert_with(|| {
                new_class(&mut classes, Member::Arg(a), arg_name(a), g.loc.clone())
            });
        }
    }

    // --- Choices.
    let state_count = |p: &str| {
        g.args
            .iter()
            .filter(|a| matches!(a.attrs.get("nns.state_of"), Some(AttrValue::Str(s)) if s == p))
            .count() as u64
    };
    for class in classes.iter_mut() {
        match class.members[0] {
            Member::Arg(a) => {
                let arg = &base.args[a];
                let ty = &g.values[arg.value];
                let here = pre_layouts[arg.value]
                    .clone()
                    .unwrap_or_else(|| Sharding::replicated(ty.rank(), mesh.axes.len()));
                let fixed =
                    here.split.iter().any(|v| v.contains(&axis)) || here.partial[axis].is_some();
                let mut layouts = vec![(
                    if fixed { "as written" } else { "R" }.to_string(),
                    here.clone(),
                )];
                for d in (0..ty.rank()).filter(|_| !fixed) {
                    if here.split[d].is_empty() && ty.shape[d] % tp == 0 && ty.shape[d] >= tp {
                        let mut s = here.clone();
                        s.split[d].push(axis);
                        layouts.push((format!("D({d})"), s));
                    }
                }
                let param = arg.is_param();
                let states = param
                    .then(|| arg.name().map(state_count).unwrap_or(0))
                    .unwrap_or(0);
                let update = g
                    .nodes
                    .iter()
                    .find(|n| n.op == "dnn.adamw" && n.inputs.first() == Some(&arg.value));
                for (label, s) in layouts {
                    let bytes = local_bytes(ty, &s);
                    // The update on the shard: operands of the parameter's shape are cut
                    // like it.
                    let seconds = update.map_or(0.0, |n| {
                        let local = TensorType::new(&s.local_shape(&ty.shape, &sizes), ty.elem);
                        let shard = |v: ValueId| {
                            if g.values[v].shape == ty.shape {
                                TensorType::new(&local.shape, g.values[v].elem)
                            } else {
                                g.values[v].clone()
                            }
                        };
                        local_node_cost(g, n, &shard, o.cluster)
                    });
                    class.choices.push(Choice {
                        label,
                        outputs: vec![s],
                        seconds,
                        memory: if param {
                            bytes * (1 + u64::from(backward) + states)
                        } else {
                            0
                        },
                        ..Choice::default()
                    });
                }
            }
            Member::Op(k) => {
                let n = &g.nodes[k];
                let pn = &pre.nodes[k];
                let at = |e: String| fail(&n.loc, format!("plan: tp-search: '{}': {e}", n.op));
                let (anno, binding) = match annotation(g, n) {
                    Ok(ab) => ab,
                    Err(_) => {
                        // No annotation (an op of another dialect): replicated.
                        let outs: Vec<Sharding> = n
                            .outputs
                            .iter()
                            .map(|&v| Sharding::replicated(g.values[v].rank(), mesh.axes.len()))
                            .collect();
                        class.choices.push(Choice {
                            label: "R".into(),
                            inputs: n
                                .inputs
                                .iter()
                                .map(|&v| {
                                    Some(Sharding::replicated(g.values[v].rank(), mesh.axes.len()))
                                })
                                .collect(),
                            grads: vec![None; n.inputs.len()],
                            reread: vec![false; n.inputs.len()],
                            outputs: outs,
                            seconds: cost::node_cost(g, n, o.cluster, None)
                                .map_or(0.0, |c| c.seconds * 3.0),
                            ..Choice::default()
                        });
                        continue;
                    }
                };
                let base_binds: Binds = directive(pn, mesh)
                    .map_err(at)?
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|(_, axes)| !axes.contains(&axis))
                    .collect();
                let bound: Vec<usize> = base_binds.iter().flat_map(|(_, a)| a.clone()).collect();
                let mut options: Vec<(String, Binds, bool, bool)> =
                    vec![("R".into(), base_binds.clone(), true, false)];
                if !bound.contains(&axis) {
                    for c in anno.split_choices(&binding) {
                        if base_binds.iter().any(|(id, _)| *id == c.id) {
                            continue;
                        }
                        let len = binding.len(&c.id).unwrap_or(1);
                        if len % tp != 0 || len < tp {
                            continue;
                        }
                        let mut b = base_binds.clone();
                        b.push((c.id.clone(), vec![axis]));
                        options.push((c.id.clone(), b, false, false));
                    }
                    if n.op == "dnn.cross_entropy" {
                        let classes_len = g.values[n.inputs[0]].shape[1];
                        if classes_len % tp == 0 {
                            options.push(("vocab".into(), base_binds.clone(), false, true));
                        }
                    }
                }
                let in_ranks: Vec<usize> = n.inputs.iter().map(|&v| g.values[v].rank()).collect();
                let out_ranks: Vec<usize> = n.outputs.iter().map(|&v| g.values[v].rank()).collect();
                let needs: Vec<bool> = n.inputs.iter().map(|&v| backward && grad[v]).collect();
                let user = g.user_ops.of_call(&n.op, &n.attrs).is_some();
                for (label, binds, closed, vocab) in options {
                    let mut l = op_layouts(
                        &anno,
                        &binding,
                        partial_kind(&n.op),
                        &binds,
                        mesh.axes.len(),
                        &in_ranks,
                        &out_ranks,
                    )
                    .map_err(at)?;
                    if vocab {
                        if let Some(Some(logits)) = l.inputs.get_mut(0) {
                            logits.split[1].push(axis);
                        }
                    }
                    let only: Vec<usize> = if closed { vec![axis] } else { Vec::new() };
                    let attr = split_attr(&binds, &only, mesh);
                    let costs = if user {
                        None
                    } else {
                        scratch_costs(
                            g,
                            n,
                            &needs,
                            &l.inputs,
                            &l.outputs,
                            attr.as_ref(),
                            mesh,
                            o.cluster,
                            backward,
                        )
                        .map_err(|e| {
                            if std::env::var("NNS_DEBUG").is_ok() {
                                eprintln!("scratch {} {label}: {e}", n.op);
                            }
                        })
                        .ok()
                    };
                    let (seconds, grads, reread, bwd_ops) = match costs {
                        Some(sc) => (sc.seconds, sc.grads, sc.reread, sc.backward),
                        None => {
                            // The mirror rule: backward twice the forward's cost.
                            let mut layout_of: HashMap<ValueId, &Sharding> = HashMap::new();
                            for (&v, sh) in n.inputs.iter().zip(&l.inputs) {
                                if let Some(sh) = sh {
                                    layout_of.insert(v, sh);
                                }
                            }
                            for (&v, sh) in n.outputs.iter().zip(&l.outputs) {
                                layout_of.insert(v, sh);
                            }
                            let local = |v: ValueId| {
                                let ty = &g.values[v];
                                let shape = layout_of.get(&v).map_or(ty.shape.clone(), |sh| {
                                    sh.local_shape(&ty.shape, &sizes)
                                });
                                TensorType::new(&shape, ty.elem)
                            };
                            let f = local_node_cost(g, n, &local, o.cluster);
                            let grads = if backward {
                                mirror_grads(&anno, &binding, &binds, &l.inputs)
                                    .into_iter()
                                    .zip(&needs)
                                    .map(|(gl, &nd)| gl.filter(|_| nd))
                                    .collect()
                            } else {
                                vec![None; n.inputs.len()]
                            };
                            (
                                f * if backward { 3.0 } else { 1.0 },
                                grads,
                                vec![backward; n.inputs.len()],
                                Vec::new(),
                            )
                        }
                    };
                    let memory = n
                        .outputs
                        .iter()
                        .zip(&l.outputs)
                        .filter(|(&v, _)| saved(v))
                        .map(|(&v, s)| local_bytes(&g.values[v], s))
                        .sum();
                    class.choices.push(Choice {
                        label,
                        binds,
                        closed,
                        inputs: l.inputs,
                        outputs: l.outputs,
                        grads,
                        reread,
                        seconds,
                        memory,
                        backward: bwd_ops,
                    });
                }
            }
        }
    }
    // User constraints on ops: a directive or pin binding the axis; a forbid over it.
    for class in classes.iter_mut() {
        let Member::Op(k) = class.members[0] else {
            continue;
        };
        let n = &g.nodes[k];
        let at = |e: String| fail(&n.loc, format!("plan: tp-search: '{}': {e}", n.op));
        let mut allowed = vec![true; class.choices.len()];
        let mut what: Vec<String> = Vec::new();
        for key in ["nns.split", "nns.pin"] {
            let Some(b) = constraint(n, key, mesh).map_err(at)? else {
                continue;
            };
            if let Some((id, _)) = b.iter().find(|(_, axes)| axes.contains(&axis)) {
                for (ok, ch) in allowed.iter_mut().zip(&class.choices) {
                    *ok &= ch.label == *id;
                }
                what.push(format!("{key} ({id} = {})", o.axis));
            }
        }
        if replicated_axes(n, mesh).map_err(at)?.contains(&axis) {
            for (ok, ch) in allowed.iter_mut().zip(&class.choices) {
                *ok &= ch.label == "R";
            }
            what.push(format!("nns.split (R({}))", o.axis));
        }
        if let Some(b) = constraint(n, "nns.forbid", mesh).map_err(at)? {
            for (id, _) in b.iter().filter(|(_, axes)| axes.contains(&axis)) {
                for (ok, ch) in allowed.iter_mut().zip(&class.choices) {
                    *ok &= ch.label != *id;
                }
                what.push(format!("nns.forbid ({id} over {})", o.axis));
            }
        }
        if !what.is_empty() {
            if !allowed.iter().any(|&a| a) {
                return Err(at(format!(
                    "{} cannot be met: no split over {} = {tp} of it is possible",
                    what.join(" and "),
                    o.axis
                )));
            }
            let what = format!("the {} of {}", what.join(" and "), class.name);
            class.constraint = Some((allowed, what, n.loc.clone()));
        }
    }

    // --- Terms: per value, transitions forward and backward.
    let mut terms: Vec<Term> = Vec::new();
    let mut impossible = Vec::new();
    // Flows of identical (producer class, result, consumer classes) are costed once and
    // counted.
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
        let mut consumers: Vec<(usize, usize)> = users[v]
            .iter()
            .filter(|&&(k, _)| fwd[k])
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
        let carries_grad = backward && grad[v];
        // Targets: distinct layouts the consumers' choices read it in.
        let mut targets: Vec<(Sharding, Vec<(usize, usize)>, Vec<(usize, usize)>)> = Vec::new();
        let mut grads: Vec<(Sharding, Vec<(usize, usize)>)> = Vec::new();
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
        for (o_idx, ch) in classes[p].choices.iter().enumerate() {
            let Some(from) = ch.outputs.get(r) else {
                continue;
            };
            for (t, when, again) in &targets {
                match transition_seconds(&mut ts, o.cluster, mesh, &ty, from, t) {
                    Some(s) => {
                        if s > 0.0 {
                            terms.push(Term {
                                class: p,
                                choice: o_idx,
                                when: when.clone(),
                                seconds: s * m,
                            });
                            if is_param && !again.is_empty() {
                                terms.push(Term {
                                    class: p,
                                    choice: o_idx,
                                    when: again.clone(),
                                    seconds: s * m,
                                });
                            }
                        }
                    }
                    None => impossible.push((p, o_idx, when.clone())),
                }
            }
            if out {
                let want = Sharding::replicated(ty.rank(), mesh.axes.len());
                match transition_seconds(&mut ts, o.cluster, mesh, &ty, from, &want) {
                    Some(s) if s > 0.0 => terms.push(Term {
                        class: p,
                        choice: o_idx,
                        when: Vec::new(),
                        seconds: s * m,
                    }),
                    Some(_) => {}
                    None => impossible.push((p, o_idx, Vec::new())),
                }
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
                    match transition_seconds(&mut ts, o.cluster, mesh, &ty, gl, &want) {
                        Some(s) if s > 0.0 => terms.push(Term {
                            class: p,
                            choice: o_idx,
                            when: when.clone(),
                            seconds: s * m,
                        }),
                        Some(_) => {}
                        None => impossible.push((p, o_idx, when.clone())),
                    }
                }
            }
        }
    }
    let cap = o.memory_cap.map(|c| {
        (
            c,
            format!("the memory_cap of {c} bytes per device on @{}", mesh.name),
        )
    });
    Ok(Prepared {
        problem: Problem {
            classes,
            terms,
            impossible,
            cap,
            cap_loc: o.cap_loc.clone(),
        },
        base,
    })
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
                && !dnn::spec(&n.op).is_some_and(|s| s.traits.optimizer)
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
                        match split_attr(&ch.binds, closed, mesh) {
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
                                match split_attr(binds, closed, mesh) {
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
) -> Result<(Graph, Prepared, Solution), Diagnostics> {
    let o = Options {
        cluster,
        axis,
        memory_cap: mesh.memory_cap.map(|c| c.max(0) as u64),
        cap_loc: SrcLoc::default(),
    };
    let prepared = prepare(&g, mesh, &o)?;
    let sol = prepared
        .problem
        .solve()
        .map_err(|e| conflict_diagnostics(&e, &g.loc, axis))?;
    let mut planned = prepared.apply(&sol, mesh, axis);
    crate::plan::state_layouts(&mut planned);
    backward_directives(&mut planned, mesh)?;
    Ok((planned, prepared, sol))
}

/// Backward ops follow their operands' layouts; where a split they would follow does not
/// divide their dimension (a gradient split on 768 / 8 reshaped into 12 heads), they are
/// given a directive replicating them over those axes (`R(tp)`), so propagation gathers
/// the operand instead of refusing the plan. Optimizer ops are left to propagation (ZeRO
/// changes their state's layouts after the plan).
fn backward_directives(g: &mut Graph, mesh: &Mesh) -> Result<(), Diagnostics> {
    let fwd = if has_backward(g) {
        forward_ops(g)
    } else {
        return Ok(());
    };
    let mut remarks = Diagnostics::default();
    let (_, decided) = propagate_lenient(g.clone(), mesh, &mut remarks)?;
    for (k, d) in decided.into_iter().enumerate() {
        let Some((binds, closed)) = d else { continue };
        let n = &g.nodes[k];
        let optimizer = dnn::spec(&n.op).is_some_and(|s| s.traits.optimizer);
        if fwd[k] || optimizer || closed.is_empty() {
            continue;
        }
        let mut s: Split = binds_to_split(&binds, mesh);
        s.replicated = closed.iter().map(|&a| mesh.axes[a].name.clone()).collect();
        g.nodes[k].attrs.insert(
            "nns.split".into(),
            AttrValue::Nns {
                kind: "split".into(),
                body: s.to_string(),
            },
        );
    }
    Ok(())
}

/// Compiles a planned step (`--propagate-layouts`, `--split-tensor`, `--lower-relayouts`,
/// `--localize`): its per-device program.
pub fn compile(planned: Graph, mesh: &Mesh) -> Result<Graph, Diagnostics> {
    let mut remarks = Diagnostics::default();
    let g = propagate(planned, mesh, &mut remarks)?;
    let g = split(g, mesh)?;
    let g = lower(g, mesh, &mut TransitionSearch::new())?;
    localize(compact(g), mesh)
}

/// [`compile`]d and predicted on `cluster`: what the search's objective estimates.
pub fn compiled_seconds(
    planned: Graph,
    mesh: &Mesh,
    cluster: &Cluster,
) -> Result<f64, Diagnostics> {
    Ok(cost::predict(&compile(planned, mesh)?, cluster, Some(mesh)).seconds())
}

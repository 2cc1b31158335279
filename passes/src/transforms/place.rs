//! `--place{stages=N}`: assigns every op of a forward program a pipeline stage
//! (`nns.stage`), contiguous in program order, so that the slowest stage is as fast as it
//! can be, within each stage's memory.
//!
//! Items: the program is coarsened into layers (`nns.layer`, or the layer its parameters
//! name — `h.3.*`, `layers.3.*` — as `--recompute` finds them); an op outside any layer,
//! and an op carrying a user constraint, is an item of its own. An 80-layer model
//! is then ~82 items, not thousands of ops. An item's cost is its FLOPs (the op specs'
//! rule; a call of a user op counts its body's FLOPs).
//!
//! Constraints kept: an op's `nns.stage` pins it, its `nns.stage_bounds = array<i64: lo,
//! hi>` bounds it, and with a `memory_cap` on the module's mesh each stage's device must
//! hold its parameters with their gradients and Adam state (4 x the parameter bytes,
//! split over `tp`) and its activations for the micro-batches the schedule keeps in flight
//! on it, split over `dp` x `tp`: read off the schedule's action order
//! ([`crate::planner::schedule::peak_in_flight_by_stage`]; 1F1B and ZB-H1: min(p - r, m) of m on
//! rank r, GPipe: m, interleaved and ZB-V per stage as the schedule orders them; the
//! interleaved schedule on 2 ranks with 4 micro-batches holds 4, 3, 2, 1 on its stages).
//!
//! Solvers (`solver=`): `z3` (default) — [`crate::planner::place_z3`], a bisection on the slowest
//! stage's cost with Z3, whose unsat core names the constraints that cannot hold together;
//! `dp` — an exact dynamic program over (stage, prefix) ([`balanced_partition`], no memory
//! caps), the oracle the Z3 placement is tested against. `layout=` gives the stages
//! explicitly, Megatron style: items `E` (the ops before the first layer), `t` (one
//! layer; `t*20` for twenty), `L` (the ops after the last layer), stages separated by `|`:
//! `layout="E,t*2|t*2,L"`.
//!
//! Run it before `--autodiff`, which gives each backward op the stage of the forward op it
//! differentiates, or on a training step (after `--autodiff`, `--recompute`,
//! `--optimizer`), which it stages as `--autodiff` would have: the forward (the ops the
//! loss depends on) is placed as above; every other op with a forward op's location (a
//! VJP rule's ops, the sums of reused gradients, `--recompute`'s clones: they all carry the
//! location of the forward op they come from) takes that op's stage; the constants
//! `--autodiff` adds at the function's location (the loss's seed, zero gradients) take
//! their earliest user's stage; the optimizer's ops (also at the function's location)
//! stay unstaged, as they are when `--optimizer` follows `--autodiff` on a placed forward
//! (the schedule passes run them after the micro-batches, on their readers' rank). So
//! `--autodiff --optimizer --place` writes what `--place --autodiff --optimizer` writes.
//! The locations must survive: in one `nnscaler-opt` run they do; a step printed and read
//! back keeps them only when printed with `--mlir-print-debuginfo` (otherwise every op
//! has its own line and the pass says so instead of guessing).
//!
//! A remark reports each stage's ops and FLOPs and the balance (slowest / mean).

use crate::layouts::error;
use crate::pass::{FunctionPass, PassOptions};
use crate::planner::place_z3::{self, Infeasible, Item, Problem};
use crate::planner::schedule::ScheduleKind;
use melior::ir::OperationRef;
use nnscaler_dialects::diag::{Diagnostics, SrcLoc};
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::spec::OpCtx;
use nnscaler_dialects::types::AttrValue;
use std::collections::HashMap;

/// How stages are chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Solver {
    Z3,
    Dp,
    Layout(String),
}

/// The pass.
#[derive(Debug)]
pub struct Place {
    stages: usize,
    solver: Solver,
    /// The schedule whose in-flight micro-batches the memory caps count (1f1b, gpipe).
    schedule: ScheduleKind,
    microbatches: Option<i64>,
    mesh: Option<Mesh>,
    remarks: Diagnostics,
}

impl Place {
    /// Reads the options (`stages`, `solver`, `layout`, `schedule`, `microbatches`).
    pub fn new(o: &PassOptions) -> Result<Self, String> {
        let layout = o.get("layout").map(str::to_string);
        let stages =
            match (o.get("stages"), &layout) {
                (Some(s), _) => s.parse().ok().filter(|&s: &usize| s >= 1).ok_or(format!(
                    "place: 'stages' must be a positive integer, not '{s}'"
                ))?,
                (None, Some(l)) => l.split('|').count(),
                (None, None) => return Err(
                    "place: give the number of stages, e.g. --place=\"stages=4\" (or layout=...)"
                        .into(),
                ),
            };
        let solver = match (o.get("solver").unwrap_or("z3"), layout) {
            (_, Some(l)) => {
                if l.split('|').count() != stages {
                    return Err(format!(
                        "place: layout '{l}' has {} stages but stages={stages}",
                        l.split('|').count()
                    ));
                }
                Solver::Layout(l)
            }
            ("z3", None) => Solver::Z3,
            ("dp", None) => Solver::Dp,
            (other, None) => {
                return Err(format!("place: unknown solver '{other}' (solvers: z3, dp)"))
            }
        };
        let name = o.get("schedule").unwrap_or("1f1b");
        let schedule = ScheduleKind::from_name(name).ok_or_else(|| {
            format!("place: unknown schedule '{name}' (1f1b, gpipe, zb-h1, zb-v, interleaved)")
        })?;
        let microbatches = o
            .get("microbatches")
            .map(|m| {
                m.parse::<i64>().ok().filter(|&m| m >= 1).ok_or(format!(
                    "place: 'microbatches' must be a positive integer, not '{m}'"
                ))
            })
            .transpose()?;
        Ok(Place {
            stages,
            solver,
            schedule,
            microbatches,
            mesh: None,
            remarks: Diagnostics::default(),
        })
    }
}

/// A run of forward ops placed together.
#[derive(Debug)]
struct Unit {
    /// Op indices, in program order.
    ops: Vec<usize>,
    /// The layer it is (`None`: ops outside any layer).
    layer: Option<String>,
    item: Item,
    /// Where its user constraint is, for messages.
    loc: Option<SrcLoc>,
}

impl FunctionPass for Place {
    fn prepare(&mut self, module: &OperationRef<'_, '_>) -> Result<(), Diagnostics> {
        let mut d = Diagnostics::default();
        let meshes = nnscaler_dialects::verify::Meshes::collect(module, &mut d);
        self.mesh = meshes.0.first().cloned();
        Ok(())
    }

    fn run_on_function(&mut self, mut g: Graph) -> Result<Option<Graph>, Diagnostics> {
        if g.is_localized() {
            return Err(error(
                &g.loc,
                "place: the function is localized; place stages before --localize",
            ));
        }
        // A training step: its forward is placed, the rest follows (see the module docs).
        let step = crate::transforms::recompute::has_backward(&g);
        let fwd = if step {
            crate::transforms::recompute::forward_ops(&g)
        } else {
            vec![true; g.nodes.len()]
        };
        if step {
            if let Some(k) = staged_backward_op(&g, &fwd) {
                return Err(error(
                    &g.nodes[k].loc,
                    format!(
                        "place: @{} is placed already: '{}', not a forward op, has a stage",
                        g.name, g.nodes[k].op
                    ),
                ));
            }
        }
        let n = fwd.iter().filter(|&&f| f).count();
        if n < self.stages {
            return Err(error(
                &g.loc,
                format!(
                    "place: @{} has {n} ops, fewer than the {} stages (every stage needs one)",
                    g.name, self.stages
                ),
            ));
        }
        let costs: Vec<f64> = g.nodes.iter().map(|node| op_flops(&g, node)).collect();
        let units = self.units(&g, &costs, &fwd)?;
        let unit_stage = match &self.solver {
            Solver::Layout(l) => {
                layout_stages(l, &units).map_err(|m| error(&g.loc, format!("place: {m}")))?
            }
            Solver::Dp => {
                let allowed: Vec<(usize, usize)> =
                    units.iter().map(|u| (u.item.lo, u.item.hi)).collect();
                let c: Vec<f64> = units.iter().map(|u| u.item.cost as f64).collect();
                balanced_partition(&c, self.stages, &allowed).map_err(|(k, why)| {
                    let loc = units[k]
                        .loc
                        .clone()
                        .unwrap_or_else(|| g.nodes[units[k].ops[0]].loc.clone());
                    error(
                        &loc,
                        format!("place: '{}': {why}", g.nodes[units[k].ops[0]].op),
                    )
                })?
            }
            Solver::Z3 => {
                // The dynamic program's optimum (pins and bounds, no memory) bounds Z3's.
                let allowed: Vec<(usize, usize)> =
                    units.iter().map(|u| (u.item.lo, u.item.hi)).collect();
                let c: Vec<f64> = units.iter().map(|u| u.item.cost as f64).collect();
                let lower_bound = balanced_partition(&c, self.stages, &allowed)
                    .ok()
                    .map(|st| {
                        let mut sums = vec![0u64; self.stages];
                        for (u, &s) in st.iter().enumerate() {
                            sums[s] = sums[s].saturating_add(units[u].item.cost);
                        }
                        sums.into_iter().max().unwrap_or(0)
                    });
                let problem = Problem {
                    lower_bound,
                    items: units.iter().map(|u| u.item.clone()).collect(),
                    stages: self.stages,
                    cap: self
                        .mesh
                        .as_ref()
                        .and_then(|m| m.memory_cap)
                        .map(|c| c.max(0) as u64),
                };
                place_z3::solve(&problem).map_err(|e| match e {
                    Infeasible::TooFew => error(
                        &g.loc,
                        format!(
                            "place: @{} has {} placeable items (layers and runs of ops), fewer than the {} stages",
                            g.name,
                            units.len(),
                            self.stages
                        ),
                    ),
                    Infeasible::Conflict(core) => {
                        let mut d = Diagnostics::default();
                        let first = units
                            .iter()
                            .find(|u| u.item.constraint.as_ref().is_some_and(|c| core.contains(c)))
                            .and_then(|u| u.loc.clone())
                            .unwrap_or_else(|| g.loc.clone());
                        d.error(
                            &first,
                            format!(
                                "place: no placement of @{} in {} stages satisfies these together: {} (stages are contiguous in program order, each non-empty, the first op on stage 0)",
                                g.name,
                                self.stages,
                                if core.is_empty() { "(the stages themselves)".to_string() } else { core.join("; ") }
                            ),
                        );
                        for u in units.iter().filter(|u| {
                            u.item.constraint.as_ref().is_some_and(|c| core.contains(c))
                        }) {
                            if let Some(l) = &u.loc {
                                if l != &first {
                                    d.note(l, "a conflicting constraint is here");
                                }
                            }
                        }
                        d
                    }
                })?
            }
        };
        let mut per = vec![(0usize, 0.0f64); self.stages];
        for (u, unit) in units.iter().enumerate() {
            let s = unit_stage[u];
            for &k in &unit.ops {
                g.nodes[k]
                    .attrs
                    .insert("nns.stage".into(), AttrValue::Int(s as i64));
                per[s].0 += 1;
                per[s].1 += costs[k];
            }
        }
        if step {
            stage_the_rest(&mut g, &fwd)?;
        }
        let max = per.iter().map(|p| p.1).fold(0.0, f64::max);
        let mean = per.iter().map(|p| p.1).sum::<f64>() / self.stages as f64;
        let list: Vec<String> = per
            .iter()
            .enumerate()
            .map(|(s, (ops, f))| format!("{s}: {ops} ops, {f:.3e} FLOPs"))
            .collect();
        self.remarks.remark(
            &g.loc,
            format!(
                "place @{}: {} stage{}; {}; slowest / mean = {:.3}",
                g.name,
                self.stages,
                if self.stages == 1 { "" } else { "s" },
                list.join("; "),
                if mean > 0.0 { max / mean } else { 1.0 }
            ),
        );
        Ok(Some(g))
    }

    fn take_remarks(&mut self) -> Diagnostics {
        std::mem::take(&mut self.remarks)
    }
}

impl Place {
    /// The items to place: layers, runs of ops outside layers, and constrained ops alone.
    fn units(&self, g: &Graph, costs: &[f64], fwd: &[bool]) -> Result<Vec<Unit>, Diagnostics> {
        let layer = crate::transforms::recompute::layers(g, fwd);
        let stages = self.stages;
        // Memory model (see the module docs).
        let axis = |a: &str| {
            self.mesh
                .as_ref()
                .and_then(|m| m.axis(a))
                .unwrap_or(1)
                .max(1) as u64
        };
        let (dp, tp) = (axis("dp"), axis("tp"));
        let p = self
            .mesh
            .as_ref()
            .and_then(|m| m.axis("pp"))
            .map_or(stages as i64, |p| p.max(1));
        let m = self
            .microbatches
            .or_else(|| {
                self.mesh
                    .as_ref()
                    .and_then(|m| m.microbatch_axis())
                    .map(|a| a.size)
            })
            .unwrap_or(1)
            .max(1);
        // Each stage's in-flight micro-batches, read off the schedule itself; a schedule
        // that cannot be made for these sizes (interleaved with m not a multiple of p)
        // falls back to the closed forms.
        let chunks = (stages as i64 / p).max(1) as usize;
        let made = (stages as i64 % p == 0)
            .then(|| self.schedule.make(p as usize, m as usize, chunks).ok())
            .flatten()
            .filter(|s| s.stages == stages);
        let in_flight: Vec<u64> = match made {
            Some(s) => crate::planner::schedule::peak_in_flight_by_stage(&s)
                .into_iter()
                .map(|x| x as u64)
                .collect(),
            None => (0..stages as i64)
                .map(|k| self.schedule.in_flight_bound(p, m, k) as u64)
                .collect(),
        };
        let mut first_use = vec![false; g.values.len()];
        let mut units: Vec<Unit> = Vec::new();
        let mut prev_constrained = false;
        for (k, node) in g.nodes.iter().enumerate().filter(|&(k, _)| fwd[k]) {
            let fail = |m: String| error(&node.loc, format!("place: '{}': {m}", node.op));
            let (mut lo, mut hi) = (0usize, stages - 1);
            let mut what: Vec<String> = Vec::new();
            if let Some(AttrValue::Ints(b)) = node.attrs.get("nns.stage_bounds") {
                if let [l, h] = b.as_slice() {
                    lo = lo.max(*l as usize);
                    hi = hi.min(*h as usize);
                    what.push(format!("stages {l}..={h}"));
                }
            }
            if let Some(AttrValue::Int(s)) = node.attrs.get("nns.stage") {
                let s = *s as usize;
                if s >= stages {
                    return Err(fail(format!(
                        "is pinned to stage {s}, but there are {stages} stages"
                    )));
                }
                lo = lo.max(s);
                hi = hi.min(s);
                what.push(format!("stage {s}"));
            }
            if lo > hi {
                return Err(fail(format!(
                    "its pin and bounds leave no stage among 0..{stages}"
                )));
            }
            let constrained = !what.is_empty();
            let mut params = 0u64;
            for &v in &node.inputs {
                let is_param = g.args.iter().any(|a| a.value == v && a.is_param());
                if is_param && !std::mem::replace(&mut first_use[v], true) {
                    params += g.values[v].bytes();
                }
            }
            let acts: u64 = node.outputs.iter().map(|&o| g.values[o].bytes()).sum();
            // A layer is one item; an op outside any layer is an item of its own.
            let fresh = constrained
                || prev_constrained
                || layer[k].is_none()
                || units.last().is_none_or(|u| u.layer != layer[k]);
            prev_constrained = constrained;
            if fresh {
                units.push(Unit {
                    ops: Vec::new(),
                    layer: layer[k].clone(),
                    item: Item {
                        cost: 0,
                        lo: 0,
                        hi: stages - 1,
                        constraint: None,
                        mem: vec![0; stages],
                    },
                    loc: None,
                });
            }
            let u = units.last_mut().expect("a unit was just made");
            u.ops.push(k);
            u.item.cost = u.item.cost.saturating_add(costs[k].max(0.0).round() as u64);
            if constrained {
                u.item.lo = lo;
                u.item.hi = hi;
                u.item.constraint = Some(format!(
                    "'{}' (line {}) on {}",
                    node.op,
                    node.loc.line,
                    what.join(" and ")
                ));
                u.loc = Some(node.loc.clone());
            }
            for (st, mem) in u.item.mem.iter_mut().enumerate() {
                let b = params.saturating_mul(4) / tp
                    + acts.saturating_mul(in_flight[st]) / (m as u64) / (dp * tp);
                *mem = mem.saturating_add(b);
            }
        }
        Ok(units)
    }
}

/// Whether `--place` can stage training step `g` (see the module docs): it has a
/// backward, nothing but forward ops carry a stage, and its backward ops carry their
/// forward ops' locations. The error says why not.
pub fn placeable(g: &Graph) -> Result<(), String> {
    if !crate::transforms::recompute::has_backward(g) {
        return Err(format!("@{} has no backward", g.name));
    }
    let fwd = crate::transforms::recompute::forward_ops(g);
    if staged_backward_op(g, &fwd).is_some() {
        return Err(format!("@{} is placed already", g.name));
    }
    let mut trial = g.clone();
    for (n, _) in trial.nodes.iter_mut().zip(&fwd).filter(|(_, &f)| f) {
        n.attrs.insert("nns.stage".into(), AttrValue::Int(0));
    }
    stage_the_rest(&mut trial, &fwd).map_err(|d| {
        d.0.first()
            .map_or_else(String::new, |e| format!("{}: {}", e.loc, e.message))
    })
}

/// An op of training step `g` outside its forward (`fwd`) that has a stage already: the
/// step is placed.
fn staged_backward_op(g: &Graph, fwd: &[bool]) -> Option<usize> {
    (0..g.nodes.len()).find(|&k| !fwd[k] && g.nodes[k].attrs.contains_key("nns.stage"))
}

/// Stages a training step's ops other than its forward, whose forward ops are staged (see
/// the module docs).
fn stage_the_rest(g: &mut Graph, fwd: &[bool]) -> Result<(), Diagnostics> {
    let staged = |k: usize| g.nodes[k].attrs.contains_key("nns.stage");
    let of = differentiated_ops(g, fwd, staged);
    let mut constants = vec![false; g.nodes.len()];
    for k in (0..g.nodes.len()).filter(|&k| !fwd[k]) {
        let n = &g.nodes[k];
        if let Some(f) = of[k] {
            let s = g.nodes[f].attrs["nns.stage"].clone();
            g.nodes[k].attrs.insert("nns.stage".into(), s);
        } else if n.loc == g.loc {
            // --autodiff's constants take their users' stage; the optimizer's ops none.
            constants[k] = n.inputs.is_empty();
        } else {
            return Err(error(
                &n.loc,
                format!(
                    "place: '{}' is not a forward op of @{} and has no forward op's location, so its stage is unknown: backward ops are staged by the location of the forward op they differentiate, which a step printed without --mlir-print-debuginfo and read back has lost (run --place before --autodiff, or in the same nnscaler-opt run)",
                    n.op, g.name
                ),
            ));
        }
    }
    complete_stages(g, &constants);
    Ok(())
}

/// For each op of training step `g` outside its forward (`fwd`), the forward op it
/// differentiates: the one whose location it carries (`--autodiff` gives each op of a
/// vector-Jacobian product its forward op's location), among the forward ops `which`
/// admits, the last one there when several share it (the casts `--autocast` puts before
/// an op carry its location). `None` for forward ops and for ops at no such location
/// (line 0, a step read back without its locations). `--place` stages a backward op as
/// this op; the plan search's profiles charge it to this op's layer.
pub(crate) fn differentiated_ops(
    g: &Graph,
    fwd: &[bool],
    which: impl Fn(usize) -> bool,
) -> Vec<Option<usize>> {
    let mut at: HashMap<&SrcLoc, usize> = HashMap::new();
    for k in (0..g.nodes.len()).filter(|&k| fwd[k] && which(k)) {
        at.insert(&g.nodes[k].loc, k);
    }
    g.nodes
        .iter()
        .zip(fwd)
        .map(|(n, &f)| {
            if f || n.loc.line == 0 {
                None
            } else {
                at.get(&n.loc).copied()
            }
        })
        .collect()
}

/// Gives the ops of `g` marked in `which` that have no stage one: the latest stage of
/// their operands' producers, else the earliest of their users', else 0 (how `--autodiff`
/// stages the ops it adds outside any forward op of a placed program).
pub(crate) fn complete_stages(g: &mut Graph, which: &[bool]) {
    let stage_of = |n: &nnscaler_dialects::graph::Node| match n.attrs.get("nns.stage") {
        Some(AttrValue::Int(s)) => Some(*s),
        _ => None,
    };
    if !g.nodes.iter().any(|n| stage_of(n).is_some()) {
        return;
    }
    let producer = g.producers();
    for k in (0..g.nodes.len()).filter(|&k| which[k]) {
        if stage_of(&g.nodes[k]).is_some() {
            continue;
        }
        let from_inputs = g.nodes[k]
            .inputs
            .iter()
            .filter_map(|&v| producer[v].and_then(|p| stage_of(&g.nodes[p])))
            .max();
        let outs = g.nodes[k].outputs.clone();
        let from_users = g
            .nodes
            .iter()
            .filter(|u| u.inputs.iter().any(|v| outs.contains(v)))
            .filter_map(stage_of)
            .min();
        let s = from_inputs.or(from_users).unwrap_or(0);
        g.nodes[k]
            .attrs
            .insert("nns.stage".into(), AttrValue::Int(s));
    }
}

/// The stage of each unit under an explicit layout (see the module docs).
fn layout_stages(layout: &str, units: &[Unit]) -> Result<Vec<usize>, String> {
    // The model's segments: E (ops before the first layer), one per layer, L (after).
    #[derive(PartialEq)]
    enum Seg {
        E,
        T,
        L,
    }
    let first_layer = units.iter().position(|u| u.layer.is_some());
    let last_layer = units.iter().rposition(|u| u.layer.is_some());
    let mut seg_of = Vec::with_capacity(units.len());
    let mut segs: Vec<Seg> = Vec::new();
    for (i, u) in units.iter().enumerate() {
        let kind = match (first_layer, last_layer) {
            (Some(f), _) if i < f => Seg::E,
            (_, Some(l)) if i > l => Seg::L,
            (None, _) => Seg::E,
            _ => Seg::T,
        };
        let new = match kind {
            Seg::T => u.layer.is_some() && (i == 0 || units[i - 1].layer != u.layer),
            _ => segs.last() != Some(&kind),
        };
        if new {
            segs.push(kind);
        }
        seg_of.push(segs.len() - 1);
    }
    let mut want: Vec<(Seg, usize)> = Vec::new();
    for (s, stage) in layout.split('|').enumerate() {
        for item in stage.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (name, count) = match item.split_once('*') {
                Some((n, c)) => (
                    n.trim(),
                    c.trim()
                        .parse::<usize>()
                        .map_err(|_| format!("layout item '{item}': the count must be a number"))?,
                ),
                None => (item, 1),
            };
            let kind = match name {
                "E" => Seg::E,
                "t" => Seg::T,
                "L" => Seg::L,
                _ => {
                    return Err(format!(
                        "layout item '{item}' is not E (before the layers), t (a layer, t*N for N) or L (after the layers)"
                    ))
                }
            };
            for _ in 0..count {
                want.push((
                    match kind {
                        Seg::E => Seg::E,
                        Seg::T => Seg::T,
                        Seg::L => Seg::L,
                    },
                    s,
                ));
            }
        }
    }
    let show = |v: &[&Seg]| {
        let t = v.iter().filter(|k| ***k == Seg::T).count();
        format!(
            "{}{} layers{}",
            if v.first().is_some_and(|k| **k == Seg::E) {
                "E, "
            } else {
                ""
            },
            t,
            if v.last().is_some_and(|k| **k == Seg::L) {
                ", L"
            } else {
                ""
            }
        )
    };
    let have: Vec<&Seg> = segs.iter().collect();
    let asked: Vec<&Seg> = want.iter().map(|w| &w.0).collect();
    if have != asked {
        return Err(format!(
            "layout '{layout}' lists {} but the program has {}",
            show(&asked),
            show(&have)
        ));
    }
    let mut out = Vec::with_capacity(units.len());
    for (u, unit) in units.iter().enumerate() {
        let s = want[seg_of[u]].1;
        if s < unit.item.lo || s > unit.item.hi {
            return Err(format!(
                "layout puts {} on stage {s}, outside its constraint",
                unit.item.constraint.clone().unwrap_or_default()
            ));
        }
        out.push(s);
    }
    if (0..layout.split('|').count()).any(|s| !out.contains(&s)) {
        return Err(format!("layout '{layout}' leaves a stage empty"));
    }
    Ok(out)
}

/// The FLOPs of one op of `g` (0 for ops without a spec).
pub fn op_flops(g: &Graph, n: &nnscaler_dialects::graph::Node) -> f64 {
    let Some(spec) = n.op.spec() else {
        return 0.0;
    };
    let operands: Vec<_> = n
        .inputs
        .iter()
        .map(|&v| Some(g.values[v].clone()))
        .collect();
    let results: Vec<_> = n.outputs.iter().map(|&v| g.values[v].clone()).collect();
    (spec.flops)(
        &OpCtx {
            operands: &operands,
            attrs: &n.attrs,
        },
        &results,
    )
}

/// Splits `costs` (in order) into `stages` contiguous non-empty runs minimising the
/// largest run's sum, with item `k` allowed only in stages `allowed[k].0..=allowed[k].1`.
/// Returns the stage of each item (non-decreasing), or the item where it is impossible and
/// why. Exact: a dynamic program over (stage, prefix), O(stages · n²).
pub fn balanced_partition(
    costs: &[f64],
    stages: usize,
    allowed: &[(usize, usize)],
) -> Result<Vec<usize>, (usize, String)> {
    let n = costs.len();
    let mut prefix = vec![0.0; n + 1];
    for i in 0..n {
        prefix[i + 1] = prefix[i] + costs[i];
    }
    // Stage `s` may hold items j..i when every one of them allows `s`.
    let ok = |s: usize, j: usize, i: usize| (j..i).all(|k| allowed[k].0 <= s && s <= allowed[k].1);
    const INF: f64 = f64::INFINITY;
    // best[s][i]: the least max cost of placing items 0..i on stages 0..=s (each non-empty).
    let mut best = vec![vec![INF; n + 1]; stages];
    let mut from = vec![vec![0usize; n + 1]; stages];
    for i in 1..=n {
        if ok(0, 0, i) {
            best[0][i] = prefix[i];
        }
    }
    for s in 1..stages {
        for i in (s + 1)..=n {
            // The last stage holds j..i; scan j downwards while stage s allows item j.
            let mut j = i;
            while j > s {
                j -= 1;
                if !(allowed[j].0 <= s && s <= allowed[j].1) {
                    break;
                }
                let c = best[s - 1][j].max(prefix[i] - prefix[j]);
                if c < best[s][i] {
                    best[s][i] = c;
                    from[s][i] = j;
                }
            }
        }
    }
    if best[stages - 1][n] == INF {
        // Name the first item whose constraints cannot be met in order.
        let mut lo_seen = 0;
        for (k, &(lo, hi)) in allowed.iter().enumerate() {
            if hi < lo_seen {
                return Err((
                    k,
                    format!(
                        "must be on a stage <= {hi}, but an earlier op is on stage {lo_seen} or later (stages are contiguous in program order)"
                    ),
                ));
            }
            lo_seen = lo_seen.max(lo);
        }
        return Err((
            0,
            format!("{n} ops cannot fill {stages} non-empty stages under their pins and bounds"),
        ));
    }
    let mut out = vec![0; n];
    let mut i = n;
    for s in (0..stages).rev() {
        let j = if s == 0 { 0 } else { from[s][i] };
        for slot in &mut out[j..i] {
            *slot = s;
        }
        i = j;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Z3's optimum equals the dynamic program's (itself checked against brute force) on
    /// random instances with pins.
    #[test]
    fn z3_equals_the_dynamic_program() {
        let mut seed = 11u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as usize
        };
        for _ in 0..60 {
            let n = 1 + next() % 10;
            let stages = 1 + next() % n.min(4);
            let costs: Vec<u64> = (0..n).map(|_| (next() % 20) as u64).collect();
            let mut its = place_z3::unconstrained(&costs, stages);
            if next() % 2 == 0 {
                let k = next() % n;
                let st = next() % stages;
                its[k].lo = st;
                its[k].hi = st;
                its[k].constraint = Some(format!("pin {k}"));
            }
            let allowed: Vec<(usize, usize)> = its.iter().map(|i| (i.lo, i.hi)).collect();
            let fcost: Vec<f64> = costs.iter().map(|&c| c as f64).collect();
            let dp = balanced_partition(&fcost, stages, &allowed);
            let z = place_z3::solve(&Problem {
                items: its,
                stages,
                cap: None,
                lower_bound: None,
            });
            let worst = |st: &[usize]| {
                let mut sums = vec![0u64; stages];
                for (k, &s) in st.iter().enumerate() {
                    sums[s] += costs[k];
                }
                sums.into_iter().max().unwrap_or(0)
            };
            match (dp, z) {
                (Ok(a), Ok(b)) => {
                    assert!(b.windows(2).all(|w| w[0] <= w[1] && w[1] - w[0] <= 1));
                    assert_eq!(worst(&a), worst(&b), "{costs:?} {stages} {allowed:?}");
                }
                (Err(_), Err(_)) => {}
                (a, b) => panic!("dp {a:?} vs z3 {b:?} on {costs:?} {stages} {allowed:?}"),
            }
        }
    }

    /// Every split of `costs` into `stages` non-empty runs, for the brute-force optimum.
    fn brute(costs: &[f64], stages: usize, allowed: &[(usize, usize)]) -> Option<f64> {
        fn go(
            costs: &[f64],
            allowed: &[(usize, usize)],
            start: usize,
            stage: usize,
            stages: usize,
            worst: f64,
            best: &mut Option<f64>,
        ) {
            let n = costs.len();
            if stage == stages {
                if start == n && best.is_none_or(|b| worst < b) {
                    *best = Some(worst);
                }
                return;
            }
            for end in start + 1..=n {
                if (start..end).any(|k| allowed[k].0 > stage || stage > allowed[k].1) {
                    break;
                }
                let c: f64 = costs[start..end].iter().sum();
                go(costs, allowed, end, stage + 1, stages, worst.max(c), best);
            }
        }
        let mut best = None;
        go(costs, allowed, 0, 0, stages, 0.0, &mut best);
        best
    }

    #[test]
    fn the_partition_is_the_brute_force_optimum() {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as usize
        };
        for _ in 0..300 {
            let n = 1 + next() % 9;
            let stages = 1 + next() % n.min(4);
            let costs: Vec<f64> = (0..n).map(|_| (next() % 10) as f64).collect();
            let mut allowed = vec![(0, stages - 1); n];
            if next() % 2 == 0 {
                let k = next() % n;
                let s = next() % stages;
                allowed[k] = (s, s);
            }
            let want = brute(&costs, stages, &allowed);
            match balanced_partition(&costs, stages, &allowed) {
                Ok(st) => {
                    let mut sums = vec![0.0; stages];
                    for (k, &s) in st.iter().enumerate() {
                        sums[s] += costs[k];
                        assert!(allowed[k].0 <= s && s <= allowed[k].1);
                    }
                    assert!(st.windows(2).all(|w| w[0] <= w[1]));
                    assert!((0..stages).all(|s| st.contains(&s)), "a stage is empty");
                    let got = sums.iter().copied().fold(0.0, f64::max);
                    assert_eq!(Some(got), want, "{costs:?} {stages} {allowed:?}");
                }
                Err(_) => assert_eq!(want, None, "{costs:?} {stages} {allowed:?}"),
            }
        }
    }

    #[test]
    fn pins_out_of_order_are_named() {
        let e = balanced_partition(&[1.0, 1.0, 1.0], 2, &[(1, 1), (0, 1), (0, 0)]).unwrap_err();
        assert_eq!(e.0, 2);
        assert!(e.1.contains("an earlier op is on stage 1"), "{}", e.1);
    }
}

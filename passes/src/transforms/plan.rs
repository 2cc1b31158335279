//! `--plan=<policy>`: writes the split directives and parameter layouts of a named
//! parallelization policy; `--propagate-layouts` derives everything else.
//!
//! * `dp` — data parallel: every data input (non-parameter argument) is split on its first
//!   dim over mesh axis `dp`; parameters stay replicated, so their gradients are reduced.
//! * `megatron` — Megatron-LM tensor parallelism over axis `tp`: a `linear` whose result
//!   reaches another `linear` through only reshapes, transposes, attention, rotary,
//!   activations and products is column-parallel (`n = tp`, weight and bias split on their
//!   first dim); the `linear`s it reaches are row-parallel (`k = tp`, weight split on its
//!   second dim). Attention heads and the MLP hidden dim are then split by propagation, and
//!   each row-parallel result is all-reduced before the residual add.
//!   Embedding tables are split on their rows and the LM head on its classes when `tp`
//!   divides the vocabulary (the cross-entropy then runs vocabulary-parallel).
//! * `dp-megatron` — both, on a `dp x tp` mesh.
//! * `megatron-sp` — Megatron with sequence parallelism: data inputs are also split on
//!   their sequence dim (1) over `tp`, so norms, residual adds and the embedding run on a
//!   sequence shard, with all_gather before column-parallel linears and reduce_scatter
//!   after row-parallel ones in place of all_reduce.
//! * `dp-megatron-sp` — both, on a `dp x tp` mesh: data inputs split on the batch over
//!   `dp` and on the sequence over `tp`.
//!
//! The mesh is the module's (`@world` with axes `dp`/`tp`), or made from the `dp=` / `tp=`
//! options when the module has none.
//!
//! Context parallelism: `sp=S` (with any policy; tp-search plans it with dp, before its
//! search over tp) adds a mesh axis `sp` (after `dp`, before `tp`) and splits every data
//! input's dim 1 (the positions) over it;
//! attention and rotary then run on a shard of the positions (`seq_axes`, set by
//! `--localize`), with the keys and values gathered over `sp`.
//!
//! Pipelines: `pp=P` adds a mesh axis `pp` (outermost) for `P` pipeline stages, and
//! `microbatches=M` a micro-batch axis `mb = M (microbatches)` (last); every data input's
//! dim 0 is then split over `mb` too, inside `dp` (each device's batch cut into `M`
//! micro-batches), so propagation makes every batch-dim value a micro-batch piece and
//! everything reduced over the batch partial over `mb` — what a `--schedule-*` pass
//! accumulates. `schedule=S` (gpipe, 1f1b, interleaved, zb-h1, zb-v) records on each
//! training step the schedule to run (`nns.schedule = "S"`), which `--schedule` then runs:
//! so a plan, `--plan=auto`'s included, carries its pipeline schedule with it.

use crate::layouts::error;
use crate::pass::{ModulePass, PassOptions};
use crate::planner::policies::{plan, policy_name, set_layout, Policy};
use crate::planner::schedule::ScheduleKind;
use crate::rewrite::rewrite_funcs;
use crate::transforms::recompute::has_backward;
use melior::ir::OperationRef;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::{Graph, ValueId};
use nnscaler_dialects::nns::{AxisLayout, Layout, Mesh};
use nnscaler_dialects::rewriter::Builder;
use nnscaler_dialects::types::AttrValue;
use nnscaler_dialects::verify::{file_loc, Meshes};

/// The pass.
#[derive(Debug)]
pub struct Plan {
    policy: Policy,
    sizes: Vec<(&'static str, Option<i64>)>,
    /// Pipeline stages (`pp=`).
    pp: Option<i64>,
    /// Context parallelism (`sp=`): the positions split over mesh axis `sp`.
    sp: Option<i64>,
    /// Micro-batches (`microbatches=`).
    microbatches: Option<i64>,
    /// ZeRO stage (`zero=`): 1 shards the optimizer state over `dp`.
    zero: u8,
    /// The cluster `tp-search` predicts costs on (`cluster=`): as written, and loaded.
    cluster: Option<(String, crate::planner::cost::Cluster)>,
    /// The pipeline schedule `--schedule` is to run (`schedule=`), written on the training
    /// steps as `nns.schedule`.
    schedule: Option<ScheduleKind>,
    remarks: Diagnostics,
}

impl Plan {
    /// Options: `policy` (also written alone: `--plan=dp`), `dp=N`, `tp=N`.
    pub fn new(o: &PassOptions) -> Result<Self, String> {
        let policy = Policy::parse(
            o.get("policy")
                .ok_or("plan needs a policy, e.g. --plan=dp")?,
        )?;
        for k in ["devices", "max_sp", "max_pp", "top"] {
            if o.get(k).is_some() {
                return Err(format!(
                    "plan: '{k}' applies to policy auto (--plan=\"auto cluster=... devices=N\")"
                ));
            }
        }
        let cluster = match (policy, o.get("cluster")) {
            (Policy::TpSearch, Some(c)) => Some((
                c.to_string(),
                crate::planner::cost::load(c).map_err(|e| format!("plan: {e}"))?,
            )),
            (Policy::TpSearch, None) => {
                return Err("plan: tp-search needs cluster=PRESET|FILE to predict costs on (presets: dgx-a100, dgx-h100, h200, cpu)".into())
            }
            (_, Some(_)) => {
                return Err("plan: 'cluster' applies to policies tp-search and auto (--plan=\"auto cluster=... devices=N\")".into())
            }
            (_, None) => None,
        };
        let size = |k: &str| -> Result<Option<i64>, String> {
            Ok(o.positive(k, "plan")?.map(|n| n as i64))
        };
        for axis in ["dp", "tp"] {
            if o.get(axis).is_some() && !policy.axes().contains(&axis) {
                return Err(format!(
                    "plan: policy '{}' uses mesh axis {} only, so '{axis}={}' would be ignored{}",
                    policy_name(policy),
                    policy.axes().join(", "),
                    o.get(axis).unwrap_or_default(),
                    if policy == Policy::MegatronSp {
                        ""
                    } else {
                        "; --plan=\"dp-megatron dp=... tp=...\" uses both"
                    }
                ));
            }
        }
        // tp-search without dp= plans one data-parallel group (dp = 1).
        let sizes = policy
            .axes()
            .iter()
            .map(|&a| {
                size(a).map(|s| {
                    let default = (policy == Policy::TpSearch && a == "dp").then_some(1);
                    (a, s.or(default))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        // ZeRO-2 needs nothing more than ZeRO-1 here: the gradients reach the sharded
        // update as reduce_scatter shards, so no device keeps a whole reduced gradient.
        let zero = match o.get("zero") {
            None | Some("0") => 0,
            Some("1") => 1,
            Some("2") => 2,
            Some("3") => 3,
            Some(z) => {
                return Err(format!(
                    "plan: 'zero={z}' is not a ZeRO stage (0: none, 1: optimizer state sharded over dp, 2: and gradients)"
                ))
            }
        };
        if zero > 0 && !policy.axes().contains(&"dp") {
            return Err(format!(
                "plan: zero={zero} shards the optimizer state over dp, which policy '{}' does not use",
                policy_name(policy)
            ));
        }
        let schedule = o
            .get("schedule")
            .map(|name| ScheduleKind::parse(name).map_err(|e| format!("plan: {e}")))
            .transpose()?;
        Ok(Plan {
            policy,
            sizes,
            schedule,
            pp: size("pp")?,
            sp: size("sp")?,
            microbatches: size("microbatches")?,
            zero,
            cluster,
            remarks: Diagnostics::default(),
        })
    }
}

impl ModulePass for Plan {
    fn run(&mut self, module: &OperationRef<'_, '_>) -> Result<(), Diagnostics> {
        let mut d = Diagnostics::default();
        let meshes = Meshes::collect(module, &mut d);
        if d.has_errors() {
            return Err(d);
        }
        let mesh = match meshes.0.as_slice() {
            [] => {
                let mut axes = Vec::new();
                if let Some(p) = self.pp {
                    axes.push(format!("pp = {p}"));
                }
                // Context parallelism sits inside data parallelism, outside tp.
                let sp = self.sp.map(|n| format!("sp = {n}"));
                let has_dp = self.sizes.iter().any(|(a, _)| *a == "dp");
                if !has_dp {
                    axes.extend(sp.clone());
                }
                for (a, s) in &self.sizes {
                    let s = s.ok_or_else(|| {
                        error(
                            &file_loc(""),
                            format!("plan: the module has no mesh; give its size, e.g. --plan=\"{} {a}=4\"", policy_name(self.policy)),
                        )
                    })?;
                    axes.push(format!("{a} = {s}"));
                    if *a == "dp" {
                        axes.extend(sp.clone());
                    }
                }
                if let Some(m) = self.microbatches {
                    axes.push(format!("mb = {m} (microbatches)"));
                }
                let axes_attr = AttrValue::nns("axes", &axes.join(", "));
                insert_mesh(module, &axes_attr).map_err(|e| error(&file_loc(""), e))?;
                let mut d = Diagnostics::default();
                Meshes::collect(module, &mut d).0[0].clone()
            }
            [m] => {
                for (a, s) in &self.sizes {
                    match (m.axis(a), s) {
                        (None, _) => {
                            return Err(error(
                                &file_loc(""),
                                format!(
                                    "plan: policy '{}' needs mesh axis '{a}', which '@{}' lacks",
                                    policy_name(self.policy),
                                    m.name
                                ),
                            ))
                        }
                        (Some(have), Some(want)) if have != *want => {
                            return Err(error(
                                &file_loc(""),
                                format!(
                                "plan: '{a}={want}' disagrees with mesh '@{}' where {a} = {have}",
                                m.name
                            ),
                            ))
                        }
                        _ => {}
                    }
                }
                let have_pp = m.axis("pp");
                let have_mb = m.microbatch_axis().map(|a| a.size);
                for (what, have, want, how) in [
                    ("pp", have_pp, self.pp, "an axis 'pp = N'"),
                    ("sp", m.axis("sp"), self.sp, "an axis 'sp = N'"),
                    (
                        "microbatches",
                        have_mb,
                        self.microbatches,
                        "a micro-batch axis 'mb = N (microbatches)'",
                    ),
                ] {
                    match (have, want) {
                        // One micro-batch is what a mesh without a micro-batch axis runs.
                        (None, Some(1)) if what == "microbatches" => {}
                        (None, Some(w)) => {
                            return Err(error(
                                &file_loc(""),
                                format!(
                                    "plan: '{what}={w}', but mesh '@{}' has no {how}; add it to the mesh or drop the mesh to let --plan make one",
                                    m.name
                                ),
                            ))
                        }
                        (Some(h), Some(w)) if h != w => {
                            return Err(error(
                                &file_loc(""),
                                format!(
                                    "plan: '{what}={w}' disagrees with mesh '@{}', which has {h}",
                                    m.name
                                ),
                            ))
                        }
                        _ => {}
                    }
                }
                m.clone()
            }
            _ => {
                return Err(error(
                    &file_loc(""),
                    "plan: the module has several meshes; only one is supported",
                ))
            }
        };
        if let Some(name) = &self.schedule {
            if mesh.axis("pp").is_none() && mesh.microbatch_axis().is_none() {
                return Err(error(
                    &file_loc(""),
                    format!(
                        "plan: 'schedule={name}' schedules a pipeline, but mesh '@{}' has neither a pipeline axis nor micro-batches; add pp=N or microbatches=N",
                        mesh.name
                    ),
                ));
            }
        }
        let (policy, zero) = (self.policy, self.zero);
        let schedule = self.schedule;
        let cluster = self.cluster.clone();
        let remarks = &mut self.remarks;
        rewrite_funcs(module, &mut |g| {
            let g = match (policy, &cluster) {
                (Policy::TpSearch, Some((_, c))) => {
                    let found = crate::planner::split_search::tp_search(g, &mesh, c, "tp")?;
                    let (g, prepared, sol) = (found.planned, found.prepared, found.solution);
                    let chosen = prepared.describe(&sol);
                    remarks.remark(
                        &g.loc,
                        format!(
                            "plan: tp-search on {} ({} classes, {} choices, one per repeated layer position): predicted {:.3e} s per step, {} bytes per device; {}",
                            c.name,
                            prepared.problem.classes.len(),
                            prepared.problem.classes.iter().map(|c| c.choices.len()).sum::<usize>(),
                            sol.seconds,
                            sol.memory,
                            if chosen.is_empty() {
                                "nothing split over tp".to_string()
                            } else {
                                format!("split over tp: {}", chosen.join(", "))
                            }
                        ),
                    );
                    g
                }
                _ => plan(g, policy, &mesh)?,
            };
            let mut g = g;
            if let Some(k) = schedule.filter(|_| has_backward(&g)) {
                g.func_attrs
                    .insert("nns.schedule".into(), AttrValue::Str(k.name().into()));
            }
            Ok(Some(if zero > 0 {
                zero_state(g, &mesh, zero, remarks)
            } else {
                g
            }))
        })?;
        // The cluster the splits were chosen for, on the module (`nns.cluster`), so that
        // --lower-relayouts prices the relayouts as the search did.
        if let Some((spec, _)) = &self.cluster {
            // SAFETY: `module` is live; the attribute is made in its context.
            unsafe {
                use nnscaler_dialects::rewriter::{set_attr, Builder};
                let b = Builder::for_op(module.to_raw());
                let a = b
                    .attribute(&AttrValue::Str(spec.clone()))
                    .map_err(|e| error(&file_loc(""), e))?;
                set_attr(module.to_raw(), crate::planner::cost::CLUSTER_ATTR, a);
            }
        }
        Ok(())
    }

    fn take_remarks(&mut self) -> Diagnostics {
        std::mem::take(&mut self.remarks)
    }
}

/// ZeRO-1: each optimizer state argument (and its next value) is split over `dp` on its
/// first whole dim that `dp` divides, else on the first dim split over other axes (tp)
/// whose blocks `dp` divides, `dp` innermost, so every data-parallel device updates its
/// shard: the gradient arrives by reduce_scatter and the next parameter leaves by
/// all_gather, both from the transition search. The next parameters keep the parameter's
/// layout (ZeRO-3: the parameters are split alike). A state no dim of which `dp` divides
/// stays as it was, with a remark.
fn zero_state(mut g: Graph, mesh: &Mesh, zero: u8, remarks: &mut Diagnostics) -> Graph {
    let Some(dp) = mesh.axis("dp").filter(|&n| n > 1) else {
        return g;
    };
    let layout_of = |attrs: &nnscaler_dialects::types::Attrs| -> Vec<(String, AxisLayout)> {
        match attrs.get("nns.layout") {
            Some(v) => match v.layout() {
                Some(Ok(l)) => l.axes.clone(),
                _ => Vec::new(),
            },
            None => Vec::new(),
        }
    };
    let mut unsharded = Vec::new();
    let mut by_name: Vec<(String, AttrValue)> = Vec::new();
    for i in 0..g.args.len() {
        let sharded =
            g.args[i].attrs.contains_key("nns.state_of") || (zero == 3 && g.args[i].is_param());
        if !sharded {
            continue;
        }
        let name = g.args[i].name().unwrap_or("").to_string();
        let mut axes = layout_of(&g.args[i].attrs);
        if axes.iter().any(|(a, _)| a == "dp") {
            continue;
        }
        let shape = g.values[g.args[i].value].shape.clone();
        let split_by = |d: usize| -> i64 {
            axes.iter()
                .filter(|(_, l)| *l == AxisLayout::D(d))
                .map(|(a, _)| mesh.axis(a).unwrap_or(1))
                .product()
        };
        // A whole dim dp divides; else a dim other axes split (tp's piece of a bias or a
        // norm's weight) whose blocks dp divides, dp then innermost: each device's block
        // cut again over dp, which is what a reduce_scatter over dp of the gradient's
        // block leaves (the search's memory model shards every state so).
        let whole = (0..shape.len()).find(|&d| split_by(d) == 1 && shape[d] % dp == 0);
        let nested = || (0..shape.len()).find(|&d| shape[d] % (split_by(d) * dp) == 0);
        let Some(d) = whole.or_else(nested) else {
            unsharded.push(name);
            continue;
        };
        axes.push(("dp".into(), AxisLayout::D(d)));
        set_layout(&mut g, i, mesh, axes);
        by_name.push((name, g.args[i].attrs["nns.layout"].clone()));
    }
    // The next state keeps the sharded layout; the next parameter its parameter's.
    for o in &mut g.outputs {
        let Some(n) = o
            .name()
            .and_then(|n| n.strip_prefix("next."))
            .map(str::to_string)
        else {
            continue;
        };
        if let Some((_, l)) = by_name.iter().find(|(s, _)| *s == n) {
            o.attrs.insert("nns.layout".into(), l.clone());
        }
    }
    let replicated = AttrValue::Layout(std::sync::Arc::new(Layout {
        mesh: mesh.name.clone(),
        axes: Vec::new(),
    }));
    let params: Vec<(String, AttrValue)> = g
        .args
        .iter()
        .filter(|a| a.is_param())
        .filter_map(|a| {
            let l = a
                .attrs
                .get("nns.layout")
                .cloned()
                .unwrap_or(replicated.clone());
            Some((a.name()?.to_string(), l))
        })
        .collect();
    for o in &mut g.outputs {
        let Some(n) = o.name().and_then(|n| n.strip_prefix("next.")) else {
            continue;
        };
        if let Some((_, l)) = params.iter().find(|(p, _)| p == n) {
            o.attrs.insert("nns.layout".into(), l.clone());
        }
    }
    // Clipping squares each gradient before the optimizer uses it: square the dp shard
    // the update needs (reduce_scatter) instead of the whole gradient (all_reduce); the
    // sums of squares are then partial, reduced as one scalar.
    // The dim dp shards and every axis splitting it, outer first (`tp` before `dp` for a
    // tensor-parallel bias's shard).
    let sharded_dim = |v: ValueId| -> Option<(usize, Vec<String>)> {
        let a = g.args.iter().find(|a| a.value == v)?;
        a.attrs.get("nns.state_of")?;
        let axes = layout_of(&a.attrs);
        let d = axes.iter().find_map(|(x, l)| match l {
            AxisLayout::D(d) if x == "dp" => Some(*d),
            _ => None,
        })?;
        let over: Vec<String> = axes
            .into_iter()
            .filter(|(_, l)| *l == AxisLayout::D(d))
            .map(|(x, _)| x)
            .collect();
        Some((d, over))
    };
    let mut directives: Vec<(usize, usize, Vec<String>)> = Vec::new();
    for n in g.nodes.iter().filter(|n| n.op == "dnn.adamw") {
        let Some((d, over)) = sharded_dim(n.inputs[2]) else {
            continue;
        };
        let grad = n.inputs[1];
        for (k, u) in g.nodes.iter().enumerate() {
            if u.op == "dnn.mul" && u.inputs == [grad, grad] {
                directives.push((k, d, over.clone()));
            }
        }
    }
    for (k, d, over) in directives {
        // The annotation's name of the result's dim d (binary ops name dims a, b, ...).
        let n = &g.nodes[k];
        let operands: Vec<Option<nnscaler_dialects::types::TensorType>> = n
            .inputs
            .iter()
            .map(|&v| Some(g.values[v].clone()))
            .collect();
        let ctx = nnscaler_dialects::spec::OpCtx {
            operands: &operands,
            attrs: &n.attrs,
        };
        let id =
            n.op.spec()
                .and_then(|s| (s.annotation)(&ctx).ok())
                .and_then(|a| {
                    a.split("->")
                        .nth(1)
                        .and_then(|out| out.split_whitespace().nth(d).map(str::to_string))
                });
        if let Some(id) = id {
            g.nodes[k]
                .attrs
                .entry("nns.split".into())
                .or_insert_with(|| {
                    AttrValue::nns(
                        "split",
                        &match over.as_slice() {
                            [one] => format!("{id} = {one}"),
                            many => format!("{id} = ({})", many.join(", ")),
                        },
                    )
                });
        }
    }
    if !unsharded.is_empty() {
        remarks.remark(
            &g.loc,
            format!(
                "plan: zero={zero} leaves {} {} unsharded: no dim of theirs, nor a split dim's block, divides by dp = {dp} ({})",
                unsharded.len(),
                if zero >= 3 {
                    "parameter(s) and optimizer state tensor(s)"
                } else {
                    "optimizer state tensor(s)"
                },
                unsharded.join(", ")
            ),
        );
    }
    g
}

/// Inserts `"nns.mesh"() {sym_name = "world", axes = ...}` first in `module`'s body, in
/// place, located at the module.
fn insert_mesh(module: &OperationRef<'_, '_>, axes: &AttrValue) -> Result<(), String> {
    let raw = module.to_raw();
    // SAFETY: `module` is live; the new op is built in its context and handed to its body.
    unsafe {
        let b = Builder::for_op(raw);
        let attrs = [
            b.named("sym_name", b.attribute(&AttrValue::Str("world".into()))?),
            b.named("axes", b.attribute(axes)?),
        ];
        let loc = mlir_sys::mlirOperationGetLocation(raw);
        let op = b.create_op("nns.mesh", &[], &[], &attrs, loc);
        let body = mlir_sys::mlirRegionGetFirstBlock(mlir_sys::mlirOperationGetRegion(raw, 0));
        mlir_sys::mlirBlockInsertOwnedOperation(body, 0, op);
    }
    Ok(())
}

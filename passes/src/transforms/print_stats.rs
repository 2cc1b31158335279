//! `--print-stats`: ops by kind, parameter count, FLOPs per training step and activation
//! bytes of every function, from the ops' specs. The seed of the cost model.
//!
//! FLOPs come from each op's `OpSpec`. A function without backward ops is a forward: its
//! training step is counted as forward + backward with backward = 2x forward (the standard
//! estimate: each matmul has two gradient matmuls). A function that has backward ops is
//! counted as written; an op is backward when it is a backward op or consumes the result of
//! one (so the matmuls autodiff emits count as backward). Activation bytes are the bytes of every value forward ops produce —
//! what a step keeps alive for backward when nothing is recomputed.

use crate::pass::{ModulePass, PassOptions};
use melior::ir::OperationRef;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::dnn;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::nns;
use nnscaler_dialects::spec::{OpCtx, OpSpec};
use nnscaler_dialects::types::{AttrValue, Attrs, TensorType};
use nnscaler_dialects::verify::{params, Meshes};
use nnscaler_dialects::view::{top_level_ops, walk_nested, FuncView, OpView};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The statistics of one function.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FuncStats {
    /// Function name.
    pub name: String,
    /// Op count by op name.
    pub ops: BTreeMap<String, u64>,
    /// Parameter tensors.
    pub param_tensors: u64,
    /// Parameter elements.
    pub params: u64,
    /// Parameter bytes.
    pub param_bytes: u64,
    /// FLOPs of forward ops.
    pub forward_flops: f64,
    /// FLOPs of backward ops present in the IR.
    pub backward_flops: f64,
    /// Whether the function has backward ops.
    pub has_backward: bool,
    /// Bytes of the values forward ops produce.
    pub activation_bytes: u64,
    /// For a localized function: the mesh (name, device count); every figure above is
    /// then per device.
    pub devices: Option<(String, i64)>,
    /// Bytes of the `grad.*` results.
    pub grad_bytes: u64,
    /// Bytes of the optimizer state arguments (`nns.state_of`, from `--optimizer`): per
    /// device once localized, so ZeRO's saving shows.
    pub state_bytes: u64,
    /// Per collective kind: (ops, bytes each device sends per step; ring algorithms).
    pub comm: BTreeMap<String, (u64, f64)>,
    /// Per pipeline stage (`nns.stage` on the ops, from `--place`), when placed.
    pub stages: BTreeMap<i64, StageStats>,
    /// For a training step: the bytes forward ops produce that the backward reads (what
    /// lives from a micro-batch's forward to its backward) — as the program is, and as it
    /// would be with `--recompute=full` and `--recompute=selective` (the same when the
    /// program is recomputed already).
    pub saved: Option<Saved>,
    /// The pipeline of the module's mesh, when it has one: (ranks, micro-batches).
    pub pipeline: Option<(i64, i64)>,
    /// The cost model's time of one run on a cluster's device (`cluster=`), with the
    /// cluster's name and device. Not for a pipeline rank's program, whose calls run
    /// fragments: see `pipeline_step`.
    pub predicted: Option<(
        String,
        crate::planner::cost::Device,
        crate::planner::cost::Prediction,
    )>,
    /// For a pipeline rank's program with `cluster=`: the pipeline's predicted step
    /// ([`crate::planner::timeline`]), or why there is none.
    pub pipeline_step: Option<Result<PipelineStep, String>>,
}

/// A pipelined program's predicted step, as one rank's program reports it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PipelineStep {
    /// The cluster's name.
    pub cluster: String,
    /// Its device's name.
    pub device: String,
    /// The pipeline's name.
    pub pipeline: String,
    /// The step: the pipeline, then the slowest rank's own ops.
    pub step: f64,
    /// The pipeline's makespan.
    pub makespan: f64,
    /// Idle time over all ranks' time in the pipeline.
    pub bubble: f64,
    /// This rank and the ranks.
    pub rank: usize,
    /// Pipeline ranks.
    pub ranks: usize,
    /// This rank's busy time in the pipeline (its fragments and sends).
    pub busy: f64,
    /// This rank's own ops outside the fragments.
    pub own: f64,
    /// Model FLOPs utilization over the step (every rank's FLOPs).
    pub mfu: f64,
    /// Whether MFU is against the bf16 peak.
    pub bf16: bool,
}

/// Bytes kept from the forward for the backward: as is, with full and with selective
/// recomputation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Saved {
    /// As the program is.
    pub now: u64,
    /// With `--recompute=full`.
    pub full: u64,
    /// With `--recompute=selective`.
    pub selective: u64,
}

/// What one pipeline stage holds and computes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageStats {
    /// Ops on it.
    pub ops: u64,
    /// FLOPs of its forward ops.
    pub forward_flops: f64,
    /// FLOPs of its backward ops.
    pub backward_flops: f64,
    /// Bytes of the values its forward ops produce (per micro-batch in flight).
    pub activation_bytes: u64,
    /// Bytes of the parameters it uses first.
    pub param_bytes: u64,
    /// Bytes its forward keeps for its backward, per micro-batch (see [`FuncStats::saved`]).
    pub saved: Saved,
}

impl FuncStats {
    /// FLOPs of one training step (see the module docs for the estimate).
    pub fn step_flops(&self) -> f64 {
        if self.has_backward {
            self.forward_flops + self.backward_flops
        } else {
            3.0 * self.forward_flops
        }
    }

    /// The human-readable report.
    pub fn report(&self) -> String {
        let mut s = String::new();
        let total: u64 = self.ops.values().sum();
        let _ = writeln!(s, "=== nnscaler stats: @{} ===", self.name);
        let _ = writeln!(s, "ops: {total}");
        let mut by_count: Vec<(&String, &u64)> = self.ops.iter().collect();
        by_count.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        for (name, n) in by_count {
            let _ = writeln!(s, "  {name:<24} {n}");
        }
        let _ = writeln!(
            s,
            "parameters: {} ({}) in {} tensors",
            group(self.params),
            bytes(self.param_bytes),
            self.param_tensors
        );
        if self.state_bytes > 0 {
            let _ = writeln!(
                s,
                "optimizer state: {} ({}, --optimizer's moments{})",
                group(self.state_bytes),
                bytes(self.state_bytes),
                if self.devices.is_some() {
                    "; one device's share"
                } else {
                    ""
                }
            );
        }
        let how = if self.has_backward {
            "forward + backward ops in the IR"
        } else {
            "forward x 3: backward estimated as 2x forward"
        };
        let _ = writeln!(
            s,
            "flops per training step: {:.4e} ({how}; forward {:.4e})",
            self.step_flops(),
            self.forward_flops
        );
        let _ = writeln!(
            s,
            "activation bytes: {} ({}, values produced by forward ops)",
            group(self.activation_bytes),
            bytes(self.activation_bytes)
        );
        if let Some(sv) = &self.saved {
            let _ = writeln!(
                s,
                "saved for the backward: {} (values forward ops produce that the backward reads, for this program's batch; with --recompute=full {}, selective {})",
                bytes(sv.now),
                bytes(sv.full),
                bytes(sv.selective)
            );
        }
        if !self.stages.is_empty() {
            let _ = writeln!(s, "pipeline stages: {} (nns.stage)", self.stages.len());
            for (k, st) in &self.stages {
                let _ = writeln!(
                    s,
                    "  stage {k}: {} ops, forward {:.4e} FLOPs, backward {:.4e} FLOPs, parameters {}, activations {}",
                    st.ops,
                    st.forward_flops,
                    st.backward_flops,
                    bytes(st.param_bytes),
                    bytes(st.activation_bytes)
                );
                if self.saved.is_some() {
                    let sv = st.saved;
                    let _ = write!(
                        s,
                        "    saved for the backward: {} (full recompute {}, selective {})",
                        bytes(sv.now),
                        bytes(sv.full),
                        bytes(sv.selective)
                    );
                    if let Some((p, m)) = self.pipeline {
                        // 1F1B keeps min(p - r, m) micro-batches in flight on rank r, each
                        // 1/m of the batch this program computes.
                        let r = *k % p.max(1);
                        let f = (p - r).min(m).max(1) as u64;
                        let m = m.max(1) as u64;
                        let _ = write!(
                            s,
                            "; 1F1B keeps {f} of {m} micro-batches in flight: {} (full {}, selective {})",
                            bytes(sv.now * f / m),
                            bytes(sv.full * f / m),
                            bytes(sv.selective * f / m)
                        );
                    }
                    s.push('\n');
                }
            }
        }
        if let Some((mesh, n)) = &self.devices {
            let _ = writeln!(
                s,
                "per device: the figures above are one device's share (localized on mesh '@{mesh}', {n} devices)"
            );
            let _ = writeln!(
                s,
                "gradient bytes: {} ({})",
                group(self.grad_bytes),
                bytes(self.grad_bytes)
            );
            let total: f64 = self.comm.values().map(|c| c.1).sum();
            let _ = writeln!(
                s,
                "communication per step: {} ({}) sent by each device",
                group(total as u64),
                bytes(total as u64)
            );
            for (k, (ops, b)) in &self.comm {
                let _ = writeln!(s, "  {k:<24} {ops} ops, {} bytes", group(*b as u64));
            }
        }
        match &self.pipeline_step {
            Some(Ok(p)) => {
                let _ = writeln!(
                    s,
                    "predicted step of pipeline @{} on {} ({}): {:.6} s (the pipeline {:.6} s, {:.1}% bubble, then the slowest rank's own ops); rank {} of {}: busy {:.6} s, own ops {:.6} s; MFU {:.1}% of the {} matrix peak",
                    p.pipeline,
                    p.device,
                    p.cluster,
                    p.step,
                    p.makespan,
                    100.0 * p.bubble,
                    p.rank,
                    p.ranks,
                    p.busy,
                    p.own,
                    100.0 * p.mfu,
                    if p.bf16 { "bf16" } else { "f32" }
                );
            }
            Some(Err(why)) => {
                let _ = writeln!(s, "predicted step: none ({why})");
            }
            None => {}
        }
        if let Some((cluster, d, p)) = &self.predicted {
            let _ = writeln!(
                s,
                "predicted time per run on {} ({cluster}): {:.6} s (matrix products {:.6} s, other ops {:.6} s, collectives {:.6} s{}; {} ops); MFU {:.1}% of the {} matrix peak",
                d.name,
                p.seconds(),
                p.matrix,
                p.other,
                p.comm,
                if p.wait > 0.0 {
                    format!(", {:.6} s of it waiting for the slowest of a group", p.wait)
                } else {
                    String::new()
                },
                p.ops,
                100.0 * p.mfu(d),
                if p.bf16 && d.matrix_flops_bf16.is_some() {
                    "bf16"
                } else {
                    "f32"
                }
            );
        }
        s
    }
}

/// `1234567` -> `1,234,567`.
fn group(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < units.len() {
        x /= 1024.0;
        u += 1;
    }
    format!("{x:.2} {}", units[u])
}

/// Computes the statistics of every function of `module`.
pub fn module_stats(module: &OperationRef<'_, '_>) -> Vec<FuncStats> {
    module_stats_on(module, None)
}

/// [`module_stats`] with each function's predicted time on `cluster`'s device.
pub fn module_stats_on(
    module: &OperationRef<'_, '_>,
    cluster: Option<&crate::planner::cost::Cluster>,
) -> Vec<FuncStats> {
    let mut out = Vec::new();
    let mut ignored = Diagnostics::default();
    let meshes = Meshes::collect(module, &mut ignored);
    // With a cluster: every function, for pipeline ranks' programs (their calls run the
    // fragments), and each pipeline's prediction once.
    let mut all: Vec<Graph> = Vec::new();
    if cluster.is_some() {
        top_level_ops(module, &mut |op| {
            if FuncView::of(op).is_some() {
                if let Ok(g) = Graph::from_func(op) {
                    all.push(g);
                }
            }
        });
    }
    let mut pipelines: BTreeMap<
        String,
        Result<crate::planner::timeline::PipelinePrediction, String>,
    > = BTreeMap::new();
    top_level_ops(module, &mut |op| {
        let Some(f) = FuncView::of(op) else { return };
        let mut st = FuncStats {
            name: f.name.clone(),
            ..FuncStats::default()
        };
        for (_, t) in params(&f) {
            st.param_tensors += 1;
            if let Some(t) = t {
                st.params += t.numel();
                st.param_bytes += t.bytes();
            }
        }
        if let Ok(g) = Graph::from_func(op) {
            let pipeline = match (
                g.func_attrs.get("nns.pipeline"),
                g.func_attrs.get("nns.pipeline_rank"),
            ) {
                (Some(AttrValue::Str(p)), Some(AttrValue::Int(r))) => {
                    Some((p.clone(), *r as usize))
                }
                _ => None,
            };
            match (cluster, pipeline) {
                (Some(c), Some((name, rank))) => {
                    let p = pipelines.entry(name.clone()).or_insert_with(|| {
                        let s = crate::planner::timeline::schedule_of(&all, &name, "the module")?;
                        let mesh = meshes.resolve(None)?;
                        crate::planner::timeline::predict_pipeline(&all, &name, &s, c, mesh)
                    });
                    st.pipeline_step =
                        Some(p.as_ref().map_err(Clone::clone).map(|p| PipelineStep {
                            cluster: c.name.clone(),
                            device: c.device.name.clone(),
                            pipeline: name.clone(),
                            step: p.step(),
                            makespan: p.timeline.makespan,
                            bubble: p.timeline.bubble_ratio(),
                            rank,
                            ranks: p.own.len(),
                            busy: p.timeline.busy.get(rank).copied().unwrap_or(0.0),
                            own: p.own.get(rank).copied().unwrap_or(0.0),
                            mfu: p.mfu(c),
                            bf16: p.bf16 && c.device.matrix_flops_bf16.is_some(),
                        }));
                }
                (Some(c), None) => {
                    let mesh = if g.is_localized() {
                        meshes.resolve(None).ok()
                    } else {
                        None
                    };
                    st.predicted = Some((
                        c.name.clone(),
                        c.device.clone(),
                        crate::planner::cost::predict(&g, &c.for_program(&g), mesh),
                    ));
                }
                (None, _) => {}
            }
            if g.is_localized() {
                collect_comm(&mut st, &g, &meshes);
            }
            st.state_bytes = g
                .args
                .iter()
                .filter(|a| a.attrs.contains_key("nns.state_of"))
                .map(|a| g.values[a.value].bytes())
                .sum();
            if crate::transforms::recompute::has_backward(&g) {
                saved_bytes(&mut st, &g);
                if let Ok(mesh) = meshes.resolve(None) {
                    if let Some(p) = mesh.axis("pp") {
                        let m = mesh.microbatch_axis().map_or(1, |a| a.size);
                        st.pipeline = Some((p, m));
                    }
                }
            }
            // An op is backward if it is a backward op or consumes a value computed by one:
            // this also counts the plain matmuls and sums that autodiff emits.
            let mut bwd = vec![false; g.values.len()];
            let stage_of = |n: &nnscaler_dialects::graph::Node| match n.attrs.get("nns.stage") {
                Some(AttrValue::Int(s)) => Some(*s),
                _ => None,
            };
            // A parameter belongs to the stage of its first user.
            for a in g.args.iter().filter(|a| a.is_param()) {
                let first = g.nodes.iter().find(|n| n.inputs.contains(&a.value));
                if let Some(s) = first.and_then(stage_of) {
                    st.stages.entry(s).or_default().param_bytes += g.values[a.value].bytes();
                }
            }
            for n in &g.nodes {
                *st.ops.entry(n.op.to_string()).or_default() += 1;
                let Some(spec) = n.op.spec() else {
                    continue;
                };
                let is_bwd = spec.grad_of.is_some() || n.inputs.iter().any(|&v| bwd[v]);
                for &o in &n.outputs {
                    bwd[o] = is_bwd;
                }
                let operands: Vec<_> = n
                    .inputs
                    .iter()
                    .map(|&v| Some(g.values[v].clone()))
                    .collect();
                let results: Vec<_> = n.outputs.iter().map(|&v| g.values[v].clone()).collect();
                let flops = count(&mut st, spec, &operands, &results, &n.attrs, is_bwd);
                if let Some(stage) = stage_of(n) {
                    let e = st.stages.entry(stage).or_default();
                    e.ops += 1;
                    if is_bwd {
                        e.backward_flops += flops;
                    } else {
                        e.forward_flops += flops;
                        e.activation_bytes += results.iter().map(|t| t.bytes()).sum::<u64>();
                    }
                }
            }
        } else {
            walk_nested(op, &mut |inner| {
                let v = OpView::of(inner);
                if v.name == "func.return" {
                    return;
                }
                *st.ops.entry(v.name.clone()).or_default() += 1;
                let Some(spec) = dnn::spec(&v.name) else {
                    return;
                };
                let results: Vec<_> = v.results.iter().flatten().cloned().collect();
                let _ = count(
                    &mut st,
                    spec,
                    &v.operands,
                    &results,
                    &v.attrs,
                    spec.grad_of.is_some(),
                );
            });
        }
        out.push(st);
    });
    out
}

/// What the forward of `g` keeps for its backward (bytes of forward-produced values that a
/// backward op reads), per stage, by the op's `nns.stage`.
fn kept(g: &Graph) -> (u64, BTreeMap<i64, u64>) {
    let fwd = crate::transforms::recompute::forward_ops(g);
    let producer = g.producers();
    let mut read = vec![false; g.values.len()];
    for (k, n) in g.nodes.iter().enumerate() {
        if !fwd[k] {
            for &v in &n.inputs {
                read[v] = true;
            }
        }
    }
    let (mut total, mut per) = (0u64, BTreeMap::new());
    for (v, &r) in read.iter().enumerate() {
        let Some(p) = producer[v].filter(|&p| r && fwd[p]) else {
            continue;
        };
        let b = g.values[v].bytes();
        total += b;
        if let Some(AttrValue::Int(s)) = g.nodes[p].attrs.get("nns.stage") {
            *per.entry(*s).or_default() += b;
        }
    }
    (total, per)
}

/// Fills `st.saved` and each stage's: as is, and with each recompute policy (computed on
/// a copy of the program; a program recomputed already counts as is).
fn saved_bytes(st: &mut FuncStats, g: &Graph) {
    use crate::transforms::recompute::{recompute, Policy};
    let done = g
        .nodes
        .iter()
        .any(|n| n.attrs.contains_key("nns.recompute"));
    let now = kept(g);
    let with = |p: Policy| {
        if done {
            now.clone()
        } else {
            kept(&recompute(g, p).0)
        }
    };
    let (full, selective) = (with(Policy::Full), with(Policy::Selective));
    st.saved = Some(Saved {
        now: now.0,
        full: full.0,
        selective: selective.0,
    });
    for (s, b) in &now.1 {
        st.stages.entry(*s).or_default().saved = Saved {
            now: *b,
            full: full.1.get(s).copied().unwrap_or(0),
            selective: selective.1.get(s).copied().unwrap_or(0),
        };
    }
}

/// Per-device gradient bytes and communication of a localized function: each collective
/// over axes of `n` devices in all moves, per device, `2(n-1)/n` of its buffer
/// (all_reduce), `(n-1)/n` of its result (all_gather) or of its operand (reduce_scatter,
/// all_to_all); a slice moves nothing.
fn collect_comm(st: &mut FuncStats, g: &Graph, meshes: &Meshes) {
    let Ok(mesh) = meshes.resolve(None) else {
        return;
    };
    st.devices = Some((mesh.name.clone(), mesh.devices()));
    for o in &g.outputs {
        if o.name().is_some_and(|n| n.starts_with("grad.")) {
            st.grad_bytes += g.values[o.value].bytes();
        }
    }
    for n in &g.nodes {
        if !n.op.starts_with("nns.") {
            continue;
        }
        let group: i64 = match n.attrs.get("axes") {
            Some(AttrValue::Strs(v)) => v.iter().map(|a| mesh.axis(a).unwrap_or(1)).product(),
            _ => 1,
        };
        let input = n.inputs.first().map_or(0, |&v| g.values[v].bytes()) as f64;
        let output = n.outputs.first().map_or(0, |&v| g.values[v].bytes()) as f64;
        // The collectives' cost model, as the transition search uses it.
        let sent = nns::sent_bytes(&n.op, group as f64, input, output);
        let e = st.comm.entry(n.op.to_string()).or_default();
        e.0 += 1;
        e.1 += sent;
    }
}

fn count(
    st: &mut FuncStats,
    spec: &OpSpec,
    operands: &[Option<TensorType>],
    results: &[TensorType],
    attrs: &Attrs,
    backward: bool,
) -> f64 {
    let ctx = OpCtx { operands, attrs };
    let flops = (spec.flops)(&ctx, results);
    if backward {
        st.has_backward = true;
        st.backward_flops += flops;
    } else {
        st.forward_flops += flops;
        st.activation_bytes += results.iter().map(|t| t.bytes()).sum::<u64>();
    }
    flops
}

/// The `--print-stats` pass.
#[derive(Debug)]
pub struct PrintStats {
    func: Option<String>,
    cluster: Option<crate::planner::cost::Cluster>,
}

impl PrintStats {
    /// From pass options (`func=NAME`, `cluster=PRESET|FILE`).
    pub fn new(options: &PassOptions) -> Result<Self, String> {
        Ok(Self {
            func: options.get("func").map(str::to_string),
            cluster: options
                .get("cluster")
                .map(|c| crate::planner::cost::load(c).map_err(|e| format!("print-stats: {e}")))
                .transpose()?,
        })
    }
}

impl ModulePass for PrintStats {
    fn run(&mut self, module: &OperationRef<'_, '_>) -> Result<(), Diagnostics> {
        let stats = module_stats_on(module, self.cluster.as_ref());
        let mut found = false;
        for st in stats {
            if self.func.as_deref().is_some_and(|f| f != st.name) {
                continue;
            }
            found = true;
            eprint!("{}", st.report());
        }
        if let (Some(f), false) = (&self.func, found) {
            let mut d = Diagnostics::default();
            d.error(
                &Default::default(),
                format!("print-stats: no function named '@{f}'"),
            );
            return Err(d);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nnscaler_dialects::context::IrContext;

    #[test]
    fn mlp_stats_are_exact() {
        let ir = IrContext::new();
        let src = r#"func.func @train(%x: tensor<8x16xf32> {nns.name = "x"}, %w: tensor<4x16xf32> {nns.name = "w", nns.param}) -> tensor<8x4xf32> {
  %0 = "dnn.linear"(%x, %w) : (tensor<8x16xf32>, tensor<4x16xf32>) -> tensor<8x4xf32>
  %1 = "dnn.relu"(%0) : (tensor<8x4xf32>) -> tensor<8x4xf32>
  return %1 : tensor<8x4xf32>
}"#;
        let m = ir.parse(src, "s.mlir").unwrap();
        let st = &module_stats(&m.as_operation())[0];
        assert_eq!(st.params, 64);
        assert_eq!(st.param_tensors, 1);
        // linear 2*8*4*16 = 1024, relu 32 -> forward 1056, step 3x.
        assert_eq!(st.forward_flops, 1056.0);
        assert_eq!(st.step_flops(), 3168.0);
        assert_eq!(st.activation_bytes, 2 * 8 * 4 * 4);
        assert_eq!(st.ops["dnn.linear"], 1);
        assert_eq!(group(1234567), "1,234,567");
    }
}

//! `--schedule-gpipe`, `--schedule-1f1b`, `--schedule-interleaved`, `--schedule-zb-h1`,
//! `--schedule-from=FILE`: turn a partitioned training step into a pipelined MPMD program.
//!
//! Input: a training function (forward, loss and `--autodiff`'s backward) whose ops carry
//! pipeline stages (`nns.stage`, from `--place` before `--autodiff`) and whose values carry
//! layouts (`--propagate-layouts`, `--split-tensor`), on a mesh with a pipeline axis (`pp`
//! by default) and, for more than one micro-batch, a micro-batch axis
//! (`mb = M (microbatches)`, which `--plan ... microbatches=M` adds and splits the data
//! inputs' batch dim over).
//!
//! Output, replacing the function `@f`:
//! * **fragments** `@f.s<stage>.<F|B|W>` (private): the forward ops of a stage, its
//!   backward ops (with a split backward, `B` computes what earlier stages need, the input
//!   gradients, and `W` the rest, the weight gradients). Each is an ordinary partitioned
//!   function over one micro-batch: its batch-dim values are split over the micro-batch
//!   axis, so `--localize` gives them micro-batch shapes, and what is reduced over the
//!   batch (the loss, gradients) is partial over it.
//! * **programs** `@f.pp<r>`, one per pipeline rank `r` (`nns.pipeline = "f"`,
//!   `nns.pipeline_rank = r`, `nns.schedule` = the rank's actions as text): the devices at
//!   `pp = r` run it. It calls its fragments in the schedule's order, one call per
//!   (fragment, micro-batch), each call tagged `nns.fragment = "<stage><kind><mb>"`; cuts
//!   micro-batch `i` out of each data input with `nns.microbatch`; sends a result another
//!   rank needs right after computing it (`nns.send`, which does not wait) and receives
//!   it right before the first call that needs it (`nns.recv`); accumulates what is
//!   partial over the micro-batch axis (`dnn.add` over micro-batches, which is the
//!   all_reduce over that axis, done in time); and then runs the ops after the
//!   accumulation (the rest of each relayout of a gradient or the loss: the data-parallel
//!   all_reduce, say) once per step. Its arguments are the original arguments it uses
//!   (`nns.arg = i`), whole over the micro-batch axis; its results are the original
//!   results its stages compute (`nns.result = i`).
//!
//! Because micro-batches are a layout axis, the means over the batch stay exact: a
//! micro-batch's loss is its part of the full-batch mean (`--localize` divides by the
//! global count), and the accumulated loss and gradients equal the single-device step's.
//!
//! Checks: the schedule itself (`schedule::verify`: every fragment once, F before B before
//! W, no cycle in the stage-to-stage order), that every fragment's inputs exist when the
//! schedule runs it on its rank, and that the programs' sends and receives cannot
//! deadlock: the programs' order plus each send-to-receive edge must be acyclic (a
//! petgraph toposort); a cycle is reported with the fragments on it.

use crate::layouts::{error, layout_attr, the_mesh, value_layouts};
use crate::pass::{ModulePass, PassOptions};
use crate::rewrite::is_ours;
use crate::schedule::{self, Action, Kind, Schedule, ScheduleKind};
use melior::ir::OperationRef;
use nnscaler_dialects::diag::{Diagnostics, SrcLoc};
use nnscaler_dialects::graph::{Graph, Node, Output, ValueId};
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::sharding::Sharding;
use nnscaler_dialects::types::{AttrValue, Attrs};
use nnscaler_dialects::verify::file_loc;
use nnscaler_dialects::view::top_level_ops;
use std::collections::{BTreeMap, HashMap};

/// Where the schedule comes from.
#[derive(Debug, Clone)]
enum Source {
    /// A generator of `schedule.rs`.
    Named(ScheduleKind),
    /// A per-rank action table (`schedule::parse_text`).
    File(String),
    /// The schedule the plan chose (`nns.schedule` on the step, from `--plan ...
    /// schedule=S` or `--plan=auto`).
    Chosen,
}

/// The pass.
#[derive(Debug)]
pub struct SchedulePass {
    flag: String,
    source: Source,
    microbatches: Option<usize>,
    chunks: usize,
    axis: String,
    remarks: Diagnostics,
}

impl SchedulePass {
    /// `--schedule-<name>`: options `microbatches` (checked against the mesh), `axis` (the
    /// pipeline axis, `pp`), `chunks` (interleaved only, 2 by default).
    pub fn named(kind: ScheduleKind, o: &PassOptions) -> Result<Self, String> {
        Self::new(format!("schedule-{kind}"), Source::Named(kind), o)
    }

    /// `--schedule-from=FILE`.
    pub fn from_file(o: &PassOptions) -> Result<Self, String> {
        let file = o
            .get("file")
            .ok_or("schedule-from: give the schedule file, --schedule-from=FILE")?;
        Self::new("schedule-from".into(), Source::File(file.to_string()), o)
    }

    /// `--schedule`: the schedule the plan chose.
    pub fn chosen(o: &PassOptions) -> Result<Self, String> {
        Self::new("schedule".into(), Source::Chosen, o)
    }

    fn new(flag: String, source: Source, o: &PassOptions) -> Result<Self, String> {
        let count = |k: &str| -> Result<Option<usize>, String> {
            Ok(o.positive(k, &flag)?.map(|n| n as usize))
        };
        let chunks = count("chunks")?;
        if chunks.is_some()
            && !matches!(
                source,
                Source::Named(ScheduleKind::Interleaved) | Source::Chosen
            )
        {
            return Err(format!(
                "{flag}: 'chunks' is an option of --schedule-interleaved and --schedule only"
            ));
        }
        Ok(SchedulePass {
            microbatches: count("microbatches")?,
            chunks: chunks.unwrap_or(2),
            axis: o.get("axis").unwrap_or("pp").to_string(),
            flag,
            source,
            remarks: Diagnostics::default(),
        })
    }

    /// The schedule for `p` ranks and `m` micro-batches; `chosen` is the step's
    /// `nns.schedule` (for [`Source::Chosen`]).
    fn schedule(&self, p: usize, m: usize, chosen: Option<&str>) -> Result<Schedule, String> {
        let s = match &self.source {
            Source::Named(k) => k.make(p, m, self.chunks)?,
            Source::Chosen => schedule::by_name(
                chosen.ok_or("the step has no chosen schedule (nns.schedule)")?,
                p,
                m,
                self.chunks,
            )?,
            Source::File(f) => {
                let text = std::fs::read_to_string(f).map_err(|e| format!("{f}: {e}"))?;
                schedule::parse_text(&text, f)?
            }
        };
        if s.devices != p {
            return Err(format!(
                "the schedule has {} ranks but the pipeline axis '{}' has {p}",
                s.devices, self.axis
            ));
        }
        if s.microbatches != m {
            return Err(format!(
                "the schedule runs {} micro-batches but the mesh cuts the batch into {m}",
                s.microbatches
            ));
        }
        schedule::verify(&s)?;
        Ok(s)
    }
}

impl ModulePass for SchedulePass {
    fn run(&mut self, module: &OperationRef<'_, '_>) -> Result<(), Diagnostics> {
        let flag = self.flag.clone();
        let here = file_loc("");
        let mut targets = Vec::new();
        let mut problems = Diagnostics::default();
        // Training steps: functions of ours returning gradients (helpers, user ops and
        // their VJPs, fragments and programs already made are left alone).
        let mut forward_only = None;
        top_level_ops(module, &mut |op| {
            if !is_ours(op) {
                return;
            }
            match Graph::from_func(op) {
                Err(e) => problems.error(&e.loc, e.message),
                Ok(g) if g.is_localized() || g.func_attrs.contains_key("nns.pipeline") => {}
                Ok(g) if !crate::recompute::has_backward(&g) => {
                    forward_only.get_or_insert((g.loc.clone(), g.name.clone()));
                }
                Ok(g) => targets.push((op.to_raw(), g)),
            }
        });
        if problems.has_errors() {
            return Err(problems);
        }
        if targets.is_empty() {
            return Err(match forward_only {
                Some((loc, name)) => error(
                    &loc,
                    format!("{flag}: @{name} has no loss and backward to pipeline; run --autodiff first (before --plan and --split-tensor)"),
                ),
                None => error(
                    &here,
                    format!("{flag}: the module has no training step to schedule (a function returning grad.* results)"),
                ),
            });
        }
        let chosen = |g: &Graph| match g.func_attrs.get("nns.schedule") {
            Some(AttrValue::Str(s)) => Some(s.clone()),
            _ => None,
        };
        if matches!(self.source, Source::Chosen) {
            // Steps the plan did not pipeline are left as they are.
            let unchosen: Vec<&Graph> = targets
                .iter()
                .map(|(_, g)| g)
                .filter(|g| chosen(g).is_none())
                .collect();
            if unchosen.len() == targets.len() {
                let mut d = Diagnostics::default();
                let meshes = nnscaler_dialects::verify::Meshes::collect(module, &mut d);
                if let Some(m) = meshes.0.first().filter(|m| {
                    m.axis(&self.axis).is_some_and(|p| p > 1) || m.microbatch_axis().is_some()
                }) {
                    return Err(error(
                        &unchosen[0].loc,
                        format!(
                            "{flag}: @{} runs on mesh '@{}', which has a pipeline axis or micro-batches, but no schedule was chosen for it; give --plan ... schedule=NAME or run a --schedule-NAME pass",
                            unchosen[0].name, m.name
                        ),
                    ));
                }
                self.remarks.remark(
                    &unchosen[0].loc,
                    format!(
                        "{flag}: @{} is not pipelined (its plan chose no schedule); left as it is",
                        unchosen[0].name
                    ),
                );
                return Ok(());
            }
            if let Some(g) = unchosen.first() {
                return Err(error(
                    &g.loc,
                    format!(
                        "{flag}: @{} has no chosen schedule (nns.schedule) while other steps have one",
                        g.name
                    ),
                ));
            }
        }
        let mesh = the_mesh(module, &flag)?;
        let p = mesh.axis(&self.axis).ok_or_else(|| {
            error(
                &here,
                format!(
                    "{flag}: mesh '@{}' has no pipeline axis '{}'; add one (--plan=\"... pp=N\", or 'pp = N' in the mesh), or name it with axis=",
                    mesh.name, self.axis
                ),
            )
        })? as usize;
        let m = mesh.microbatch_axis().map_or(1, |a| a.size as usize);
        if let Some(want) = self.microbatches.filter(|&w| w != m) {
            return Err(error(
                &here,
                if mesh.microbatch_axis().is_none() {
                    format!(
                        "{flag}: microbatches={want}, but mesh '@{}' has no micro-batch axis: the batch is cut into micro-batches before --propagate-layouts; add 'microbatches={want}' to --plan (or an axis 'mb = {want} (microbatches)' to the mesh, splitting the data inputs' batch dim)",
                        mesh.name
                    )
                } else {
                    format!(
                        "{flag}: microbatches={want}, but mesh '@{}' cuts the batch into {m}",
                        mesh.name
                    )
                },
            ));
        }
        for (raw, g) in targets {
            let sched = self
                .schedule(p, m, chosen(&g).as_deref())
                .map_err(|e| error(&g.loc, format!("{flag}: {e}")))?;
            let made = build(&g, &mesh, &sched, &self.axis, &flag)?;
            let mut after = raw;
            for f in &made {
                // SAFETY: `raw` is the live function the graphs were made from, a top-level
                // op of `module`, and `after` the function inserted last after it.
                after = unsafe { f.write_as_new_function(raw, after) }
                    .map_err(|e| error(&g.loc, format!("{flag}: {e}")))?;
            }
            // SAFETY: `raw` is a live top-level function nothing else refers to any more
            // (its callers, if any, are not ours to rewrite: the verifier reports them).
            unsafe { nnscaler_dialects::rewriter::erase(raw) }
                .map_err(|e| error(&g.loc, format!("{flag}: {e}")))?;
        }
        Ok(())
    }

    fn take_remarks(&mut self) -> Diagnostics {
        std::mem::take(&mut self.remarks)
    }
}

/// How a value relates to the micro-batch axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mb {
    /// The same in every micro-batch (no batch dim, or no micro-batch axis).
    Whole,
    /// A micro-batch's piece (its batch dim is split over the axis).
    Piece,
    /// A micro-batch's contribution to a sum over the batch (partial over the axis).
    Partial,
}

fn mb_of(s: &Sharding, mbi: Option<usize>) -> Mb {
    let Some(a) = mbi else { return Mb::Whole };
    if s.partial.get(a).is_some_and(Option::is_some) {
        Mb::Partial
    } else if s.split.iter().any(|axes| axes.contains(&a)) {
        Mb::Piece
    } else {
        Mb::Whole
    }
}

/// `s` without the micro-batch axis.
fn drop_mb(s: &Sharding, mbi: Option<usize>) -> Sharding {
    let mut s = s.clone();
    if let Some(a) = mbi {
        for axes in &mut s.split {
            axes.retain(|&x| x != a);
        }
        if let Some(p) = s.partial.get_mut(a) {
            *p = None;
        }
    }
    s
}

fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::F => "F",
        Kind::B => "B",
        Kind::W => "W",
    }
}

/// One fragment: its ops (node indices, in program order), inputs and outputs (values of
/// the original function).
#[derive(Debug, Default)]
struct Fragment {
    nodes: Vec<usize>,
    inputs: Vec<ValueId>,
    outputs: Vec<ValueId>,
}

fn stage_attr(n: &Node) -> Option<usize> {
    match n.attrs.get("nns.stage") {
        Some(AttrValue::Int(s)) if *s >= 0 => Some(*s as usize),
        _ => None,
    }
}

/// Builds the fragments and per-rank programs replacing `g` (see the module docs).
fn build(
    g: &Graph,
    mesh: &Mesh,
    sched: &Schedule,
    axis: &str,
    flag: &str,
) -> Result<Vec<Graph>, Diagnostics> {
    let fail = |loc: &SrcLoc, m: String| error(loc, format!("{flag}: {m}"));
    // What the pass needs: a backward, stages and layouts.
    let has_loss = g
        .outputs
        .iter()
        .any(|o| !o.name().is_some_and(|n| n.starts_with("grad.")));
    if !(has_loss && crate::recompute::has_backward(g)) {
        return Err(fail(
            &g.loc,
            format!("@{} has no loss and backward to pipeline; run --autodiff first (before --plan and --split-tensor)", g.name),
        ));
    }
    if let Some(n) = g
        .nodes
        .iter()
        .find(|n| n.op.starts_with("dnn.") && !n.attrs.contains_key("nns.layouts"))
    {
        return Err(fail(
            &n.loc,
            format!(
                "'{}' has no layout; run --propagate-layouts and --split-tensor first",
                n.op
            ),
        ));
    }
    if !g.nodes.iter().any(|n| stage_attr(n).is_some()) {
        return Err(fail(
            &g.loc,
            format!(
                "@{} has no pipeline stages (nns.stage); run --place{{stages={}}} before --autodiff, which gives each backward op its forward op's stage",
                g.name, sched.stages
            ),
        ));
    }
    let layouts: Vec<Sharding> = value_layouts(g, mesh)?
        .into_iter()
        .enumerate()
        .map(|(v, l)| {
            l.unwrap_or_else(|| Sharding::replicated(g.values[v].rank(), mesh.axes.len()))
        })
        .collect();
    let mbi = mesh.axes.iter().position(|a| a.microbatches);
    let mbk: Vec<Mb> = layouts.iter().map(|l| mb_of(l, mbi)).collect();
    let n = g.nodes.len();
    let mut producer: Vec<Option<usize>> = vec![None; g.values.len()];
    let mut users: Vec<Vec<usize>> = vec![Vec::new(); g.values.len()];
    for (k, node) in g.nodes.iter().enumerate() {
        for &o in &node.outputs {
            producer[o] = Some(k);
        }
        for &i in &node.inputs {
            users[i].push(k);
        }
    }
    let arg_index: HashMap<ValueId, usize> = g
        .args
        .iter()
        .enumerate()
        .map(|(i, a)| (a.value, i))
        .collect();

    // Post ops: from each accumulation (a relayout of a value partial over micro-batches
    // to one that is not) on; they run once per step, after every micro-batch.
    let mut post = vec![false; n];
    for (k, node) in g.nodes.iter().enumerate() {
        let ins: Vec<Mb> = node.inputs.iter().map(|&v| mbk[v]).collect();
        let outs: Vec<Mb> = node.outputs.iter().map(|&v| mbk[v]).collect();
        let from_post = node
            .inputs
            .iter()
            .any(|&v| producer[v].is_some_and(|p| post[p]));
        if node.op == "nns.relayout" && !from_post {
            match (ins[0], outs[0]) {
                (Mb::Partial, Mb::Whole) => post[k] = true,
                (a, b) if a != b && !(a == Mb::Partial && b == Mb::Piece) => {
                    return Err(fail(
                        &node.loc,
                        if a == Mb::Piece {
                            "this relayout gathers the whole batch from its micro-batches; a pipelined program must run everything up to the loss on one micro-batch (an op reducing over the batch mid-model, like batch norm, cannot be micro-batched)".to_string()
                        } else {
                            "this relayout would cut a value that is the same in every micro-batch into micro-batches".to_string()
                        },
                    ))
                }
                (Mb::Partial, Mb::Piece) => {
                    return Err(fail(
                        &node.loc,
                        "this relayout reduces over the micro-batches into a batch-split value; only the loss and gradients may be reduced over the batch".into(),
                    ))
                }
                _ => {}
            }
            continue;
        }
        if from_post {
            post[k] = true;
            if let Some(&v) = node
                .inputs
                .iter()
                .find(|&&v| mbk[v] == Mb::Piece && !producer[v].is_some_and(|p| post[p]))
            {
                return Err(fail(
                    &node.loc,
                    format!(
                        "'{}' combines a value accumulated over the micro-batches with a micro-batch's piece ({}); only the loss and gradients may be reduced over the batch",
                        node.op, g.values[v]
                    ),
                ));
            }
        }
    }

    // An op that reads only arguments and post values and whose results only post ops read
    // (ZeRO's relayout of a parameter to the shard its sharded update reads) runs after the
    // micro-batches too, on its readers' rank, instead of on whatever rank per micro-batch.
    let returned_value: Vec<bool> = {
        let mut r = vec![false; g.values.len()];
        for o in &g.outputs {
            r[o.value] = true;
        }
        r
    };
    for k in (0..n).rev() {
        let node = &g.nodes[k];
        if post[k] || node.outputs.is_empty() {
            continue;
        }
        let whole_inputs = node.inputs.iter().all(|&v| match producer[v] {
            Some(p) => post[p],
            None => arg_index.contains_key(&v) && mbk[v] == Mb::Whole,
        });
        let post_users = node.outputs.iter().all(|&o| {
            !returned_value[o] && !users[o].is_empty() && users[o].iter().all(|&u| post[u])
        });
        if whole_inputs && post_users {
            post[k] = true;
        }
    }

    // Stages: the op's own, else its earliest staged user's, else its latest staged
    // producer's (relayouts added by --split-tensor run where their result is used: a value
    // crossing stages is sent as it is and relayouted by the receiver).
    let mut stage: Vec<Option<usize>> = g.nodes.iter().map(stage_attr).collect();
    loop {
        let mut changed = false;
        for k in 0..n {
            if stage[k].is_some() {
                continue;
            }
            let from_users = g.nodes[k]
                .outputs
                .iter()
                .flat_map(|&o| users[o].iter())
                .filter(|&&u| post[k] || !post[u])
                .filter_map(|&u| stage[u])
                .min();
            let from_in = || {
                g.nodes[k]
                    .inputs
                    .iter()
                    .filter_map(|&v| producer[v].and_then(|p| stage[p]))
                    .max()
            };
            if let Some(s) = from_users.or_else(from_in) {
                stage[k] = Some(s);
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    let stage: Vec<usize> = stage.into_iter().map(|s| s.unwrap_or(0)).collect();
    let stages = sched.stages;
    let placed = stage.iter().max().map_or(0, |s| s + 1);
    if placed != stages {
        let how = if sched.stages != sched.devices {
            format!(
                " ({} ranks x {} chunks per rank)",
                sched.devices,
                stages / sched.devices
            )
        } else {
            String::new()
        };
        return Err(fail(
            &g.loc,
            format!(
                "@{} is placed in {placed} stages, but schedule '{}' runs {stages}{how}; place it with --place{{stages={stages}}} before --autodiff",
                g.name, sched.name
            ),
        ));
    }

    // Forward: what the loss depends on.
    let fwd = crate::recompute::forward_ops(g);
    // Kinds; with a split backward, W is what no other stage waits for.
    let mut kind: Vec<Kind> = (0..n)
        .map(|k| if fwd[k] { Kind::F } else { Kind::B })
        .collect();
    if sched.split_backward {
        let mut needed = vec![false; n];
        for k in (0..n).rev() {
            if post[k] || kind[k] != Kind::B {
                continue;
            }
            needed[k] = g.nodes[k].outputs.iter().any(|&o| {
                users[o]
                    .iter()
                    .any(|&u| !post[u] && (stage[u] != stage[k] || needed[u]))
            });
        }
        for k in 0..n {
            if kind[k] == Kind::B && !post[k] && !needed[k] {
                kind[k] = Kind::W;
            }
        }
    }
    for (s, used) in (0..stages).map(|s| (s, (0..n).any(|k| !post[k] && stage[k] == s && fwd[k]))) {
        if !used {
            return Err(fail(
                &g.loc,
                format!(
                    "stage {s} of @{} has no forward op; place fewer stages",
                    g.name
                ),
            ));
        }
    }

    // Fragments.
    let mut frags: BTreeMap<(usize, Kind), Fragment> = BTreeMap::new();
    let mut frag_of: Vec<Option<(usize, Kind)>> = vec![None; n];
    for k in 0..n {
        if post[k] {
            continue;
        }
        let key = (stage[k], kind[k]);
        frags.entry(key).or_default().nodes.push(k);
        frag_of[k] = Some(key);
    }
    let def_frag = |v: ValueId| producer[v].and_then(|p| frag_of[p]);
    let returned: Vec<bool> = {
        let mut r = vec![false; g.values.len()];
        for o in &g.outputs {
            r[o.value] = true;
        }
        r
    };
    for (key, f) in frags.iter_mut() {
        for &k in &f.nodes {
            for &v in &g.nodes[k].inputs {
                if def_frag(v) != Some(*key) && !f.inputs.contains(&v) {
                    f.inputs.push(v);
                }
            }
            for &o in &g.nodes[k].outputs {
                let outside = returned[o] || users[o].iter().any(|&u| frag_of[u] != Some(*key));
                if outside {
                    f.outputs.push(o);
                }
            }
        }
    }

    // The fragment functions.
    let mut out = Vec::new();
    let frag_name = |(s, k): (usize, Kind)| format!("{}.s{s}.{}", g.name, kind_name(k));
    for (&key, f) in &frags {
        let mut fg = Graph {
            name: frag_name(key),
            loc: g.loc.clone(),
            user_ops: g.user_ops.clone(),
            ..Graph::default()
        };
        let mut map: HashMap<ValueId, ValueId> = HashMap::new();
        for &v in &f.inputs {
            let mut attrs = Attrs::new();
            if let Some(i) = arg_index.get(&v) {
                attrs = g.args[*i].attrs.clone();
            }
            attrs.insert("nns.layout".into(), layout_attr(&layouts[v], mesh));
            map.insert(v, fg.add_arg(g.values[v].clone(), attrs));
        }
        for &k in &f.nodes {
            let node = &g.nodes[k];
            let inputs: Vec<ValueId> = node.inputs.iter().map(|v| map[v]).collect();
            let types = node.outputs.iter().map(|&o| g.values[o].clone()).collect();
            let outs = fg.add_raw(&node.op, &inputs, types, node.attrs.clone(), &node.loc);
            for (&o, &n2) in node.outputs.iter().zip(&outs) {
                map.insert(o, n2);
            }
        }
        for &v in &f.outputs {
            let mut attrs = Attrs::new();
            attrs.insert("nns.layout".into(), layout_attr(&layouts[v], mesh));
            fg.outputs.push(Output {
                value: map[&v],
                attrs,
            });
        }
        fg.func_attrs
            .insert("sym_visibility".into(), AttrValue::Str("private".into()));
        fg.func_attrs.insert(
            "nns.fragment".into(),
            AttrValue::Str(format!("{}{}", key.0, kind_name(key.1))),
        );
        out.push(fg);
    }

    // The programs.
    let p = sched.devices;
    let rank_of = |s: usize| sched.device_of[s];
    // Which ranks read each value computed in a fragment (besides its own).
    let mut readers: HashMap<ValueId, Vec<usize>> = HashMap::new();
    for (&(s, _), f) in &frags {
        for &v in &f.inputs {
            if let Some((ps, _)) = def_frag(v) {
                let r = rank_of(s);
                if rank_of(ps) != r {
                    let e = readers.entry(v).or_default();
                    if !e.contains(&r) {
                        e.push(r);
                    }
                }
            }
        }
    }
    // The stage of each post op and of each result.
    let value_stage = |v: ValueId| producer[v].map(|p| stage[p]);
    // Which other ranks' post ops read each post value.
    let mut post_readers: HashMap<ValueId, Vec<usize>> = HashMap::new();
    for k in (0..n).filter(|&k| post[k]) {
        let reader = rank_of(stage[k]);
        for &v in &g.nodes[k].inputs {
            if producer[v].is_some_and(|p| post[p] && rank_of(stage[p]) != reader) {
                let e = post_readers.entry(v).or_default();
                if !e.contains(&reader) {
                    e.push(reader);
                }
            }
        }
    }
    // A send's or receive's attributes: the pipeline axis, the peer rank and the tag.
    let transfer = |peer: usize, tag: String| {
        let mut attrs = Attrs::new();
        attrs.insert("axis".into(), AttrValue::Str(axis.to_string()));
        attrs.insert("peer".into(), AttrValue::Int(peer as i64));
        attrs.insert("tag".into(), AttrValue::Str(tag));
        attrs
    };
    let mut programs = Vec::new();
    for r in 0..p {
        let mut pg = Graph {
            name: format!("{}.pp{r}", g.name),
            loc: g.loc.clone(),
            user_ops: g.user_ops.clone(),
            func_attrs: g.func_attrs.clone(),
            ..Graph::default()
        };
        // Arguments: the original ones this rank's fragments and post ops read.
        let mut used_args = vec![false; g.args.len()];
        for (&(s, _), f) in &frags {
            if rank_of(s) == r {
                for v in &f.inputs {
                    if let Some(&i) = arg_index.get(v) {
                        used_args[i] = true;
                    }
                }
            }
        }
        for k in (0..n).filter(|&k| post[k] && rank_of(stage[k]) == r) {
            for v in &g.nodes[k].inputs {
                if let Some(&i) = arg_index.get(v) {
                    used_args[i] = true;
                }
            }
        }
        for o in &g.outputs {
            if value_stage(o.value).is_none() && r == 0 {
                if let Some(&a) = arg_index.get(&o.value) {
                    used_args[a] = true;
                }
            }
        }
        let mut arg_val: HashMap<ValueId, ValueId> = HashMap::new();
        for (i, a) in g.args.iter().enumerate() {
            if !used_args[i] {
                continue;
            }
            let mut attrs = a.attrs.clone();
            attrs.insert(
                "nns.layout".into(),
                layout_attr(&drop_mb(&layouts[a.value], mbi), mesh),
            );
            attrs.insert("nns.arg".into(), AttrValue::Int(i as i64));
            arg_val.insert(a.value, pg.add_arg(g.values[a.value].clone(), attrs));
        }
        let mut sliced: HashMap<(ValueId, usize), ValueId> = HashMap::new();
        let mut avail: HashMap<(ValueId, usize), ValueId> = HashMap::new();
        let mut acc: HashMap<ValueId, ValueId> = HashMap::new();
        let mut last: HashMap<ValueId, ValueId> = HashMap::new();
        let layouts_attr = |ls: Vec<&Sharding>| {
            let ls: Vec<Sharding> = ls.into_iter().cloned().collect();
            crate::layouts::layouts_attr(&ls, mesh)
        };
        let mut text = Vec::new();
        for a in &sched.actions[r] {
            text.push(a.to_string());
            let key = (a.stage, a.kind);
            let Some(f) = frags.get(&key) else {
                continue;
            };
            let j = a.mb;
            let mut ins = Vec::with_capacity(f.inputs.len());
            for &v in &f.inputs {
                let got = if let Some(&av) = arg_val.get(&v) {
                    if mbk[v] == Mb::Piece {
                        let axis_name =
                            mesh.axes[mbi.expect("a piece needs the axis")].name.clone();
                        *sliced.entry((v, j)).or_insert_with(|| {
                            let mut attrs = Attrs::new();
                            attrs.insert("axes".into(), AttrValue::Strs(vec![axis_name]));
                            let dim = layouts[v]
                                .split
                                .iter()
                                .position(|axes| mbi.is_some_and(|m| axes.contains(&m)))
                                .unwrap_or(0);
                            attrs.insert("dim".into(), AttrValue::Int(dim as i64));
                            attrs.insert("index".into(), AttrValue::Int(j as i64));
                            attrs.insert("nns.layouts".into(), layouts_attr(vec![&layouts[v]]));
                            pg.add_raw(
                                "nns.microbatch",
                                &[av],
                                vec![g.values[v].clone()],
                                attrs,
                                &g.loc,
                            )[0]
                        })
                    } else {
                        av
                    }
                } else if let Some(&have) = avail.get(&(v, j)) {
                    have
                } else {
                    let (ps, pk) = def_frag(v)
                        .expect("a fragment input is an argument or a fragment's result");
                    let from = rank_of(ps);
                    if from == r {
                        return Err(fail(
                            &g.loc,
                            format!(
                                "the schedule runs {a} on rank {r} before {}, whose result it needs",
                                Action { stage: ps, kind: pk, mb: j }
                            ),
                        ));
                    }
                    let mut attrs = transfer(from, format!("v{v}.mb{j}"));
                    attrs.insert("nns.layouts".into(), layouts_attr(vec![&layouts[v]]));
                    let loc = producer[v].map_or(g.loc.clone(), |p| g.nodes[p].loc.clone());
                    let got =
                        pg.add_raw("nns.recv", &[], vec![g.values[v].clone()], attrs, &loc)[0];
                    avail.insert((v, j), got);
                    got
                };
                ins.push(got);
            }
            let mut attrs = Attrs::new();
            attrs.insert(
                "callee".into(),
                AttrValue::Other(format!("@{}", frag_name(key))),
            );
            attrs.insert("nns.fragment".into(), AttrValue::Str(a.to_string()));
            // A result partial over the micro-batches is, in the program, this micro-batch's
            // contribution to the step's value: its layout there lacks the micro-batch axis.
            let result_layouts: Vec<Sharding> = f
                .outputs
                .iter()
                .map(|&v| match mbk[v] {
                    Mb::Partial => drop_mb(&layouts[v], mbi),
                    _ => layouts[v].clone(),
                })
                .collect();
            attrs.insert(
                "nns.layouts".into(),
                crate::layouts::layouts_attr(&result_layouts, mesh),
            );
            let types = f.outputs.iter().map(|&v| g.values[v].clone()).collect();
            let outs = pg.add_raw("func.call", &ins, types, attrs, &g.loc);
            // Sends first (the next rank waits for them), then the accumulations.
            for (&v, &o) in f.outputs.iter().zip(&outs) {
                avail.insert((v, j), o);
                for &to in readers.get(&v).map(Vec::as_slice).unwrap_or(&[]) {
                    let loc = producer[v].map_or(g.loc.clone(), |p| g.nodes[p].loc.clone());
                    pg.add_raw(
                        "nns.send",
                        &[o],
                        vec![],
                        transfer(to, format!("v{v}.mb{j}")),
                        &loc,
                    );
                }
            }
            for (&v, &o) in f.outputs.iter().zip(&outs) {
                let for_post = returned[v] || users[v].iter().any(|&u| post[u]);
                if !for_post {
                    continue;
                }
                match mbk[v] {
                    Mb::Partial => {
                        let sum = match acc.get(&v) {
                            None => o,
                            Some(&prev) => {
                                let mut attrs = Attrs::new();
                                attrs.insert(
                                    "nns.layouts".into(),
                                    layouts_attr(vec![&drop_mb(&layouts[v], mbi)]),
                                );
                                attrs.insert("nns.accumulate".into(), AttrValue::Unit);
                                pg.add_raw(
                                    "dnn.add",
                                    &[prev, o],
                                    vec![g.values[v].clone()],
                                    attrs,
                                    &g.loc,
                                )[0]
                            }
                        };
                        acc.insert(v, sum);
                    }
                    _ => {
                        last.insert(v, o);
                    }
                }
            }
        }
        // After every micro-batch: the post ops of this rank's stages. A value another
        // rank's post op reads (a sum of squares for clipping, its factor) is sent as soon
        // as it is computed and received right before its first use.
        let mut map: HashMap<ValueId, ValueId> = HashMap::new();
        let resolve = |v: ValueId, map: &HashMap<ValueId, ValueId>| -> Option<ValueId> {
            map.get(&v)
                .or_else(|| arg_val.get(&v))
                .or_else(|| acc.get(&v))
                .or_else(|| last.get(&v))
                .copied()
        };
        for k in (0..n).filter(|&k| post[k] && rank_of(stage[k]) == r) {
            let node = &g.nodes[k];
            let mut inputs = Vec::new();
            for &v in &node.inputs {
                let x = match resolve(v, &map) {
                    Some(x) => x,
                    None => {
                        let from = producer[v]
                            .filter(|&p| post[p] && rank_of(stage[p]) != r)
                            .map(|p| rank_of(stage[p]))
                            .ok_or_else(|| {
                                fail(
                                    &node.loc,
                                    format!(
                                        "'{}' after the micro-batches reads a value computed per micro-batch on another pipeline rank; that is not supported yet",
                                        node.op
                                    ),
                                )
                            })?;
                        let mut attrs = transfer(from, format!("post.v{v}"));
                        attrs.insert("nns.layouts".into(), layouts_attr(vec![&layouts[v]]));
                        let got = pg.add_raw(
                            "nns.recv",
                            &[],
                            vec![g.values[v].clone()],
                            attrs,
                            &node.loc,
                        )[0];
                        map.insert(v, got);
                        got
                    }
                };
                inputs.push(x);
            }
            let accumulation = node.op == "nns.relayout"
                && mbk[node.inputs[0]] == Mb::Partial
                && drop_mb(&layouts[node.inputs[0]], mbi) == layouts[node.outputs[0]];
            let outs = if accumulation {
                vec![inputs[0]]
            } else {
                let types = node.outputs.iter().map(|&o| g.values[o].clone()).collect();
                pg.add_raw(&node.op, &inputs, types, node.attrs.clone(), &node.loc)
            };
            for (&o, &n2) in node.outputs.iter().zip(&outs) {
                map.insert(o, n2);
                for &to in post_readers.get(&o).map(Vec::as_slice).unwrap_or(&[]) {
                    pg.add_raw(
                        "nns.send",
                        &[n2],
                        vec![],
                        transfer(to, format!("post.v{o}")),
                        &node.loc,
                    );
                }
            }
        }
        for (i, o) in g.outputs.iter().enumerate() {
            let mine = match value_stage(o.value) {
                Some(s) => rank_of(s) == r,
                None => r == 0,
            };
            if !mine {
                continue;
            }
            let v = resolve(o.value, &map).ok_or_else(|| {
                fail(
                    &g.loc,
                    format!(
                        "result {i} of @{} is computed per micro-batch; a pipelined step returns only values reduced over the batch (the loss, gradients) or the same in every micro-batch",
                        g.name
                    ),
                )
            })?;
            let mut attrs = o.attrs.clone();
            attrs.insert("nns.result".into(), AttrValue::Int(i as i64));
            pg.outputs.push(Output { value: v, attrs });
        }
        pg.func_attrs
            .insert("nns.pipeline".into(), AttrValue::Str(g.name.clone()));
        pg.func_attrs
            .insert("nns.pipeline_rank".into(), AttrValue::Int(r as i64));
        pg.func_attrs.insert(
            "nns.schedule".into(),
            AttrValue::Str(format!("{}: {}", sched.name, text.join(" "))),
        );
        programs.push(pg);
    }
    check_deadlock(&programs).map_err(|m| fail(&g.loc, m))?;
    out.extend(programs);
    Ok(out)
}

/// Checks that the programs' sends and receives cannot deadlock: every receive has one
/// matching send (same tag, from its peer), and the programs' orders plus send → receive
/// edges form no cycle. Sends do not wait.
fn check_deadlock(programs: &[Graph]) -> Result<(), String> {
    use petgraph::graph::DiGraph;
    let mut dg: DiGraph<(usize, usize), ()> = DiGraph::new();
    let mut sends: HashMap<(usize, usize, String), petgraph::graph::NodeIndex> = HashMap::new();
    let mut recvs = Vec::new();
    let describe = |r: usize, k: usize| -> String {
        let n = &programs[r].nodes[k];
        let what = match (n.attrs.get("nns.fragment"), n.attrs.get("tag")) {
            (Some(AttrValue::Str(f)), _) => f.clone(),
            (_, Some(AttrValue::Str(t))) => format!("{} {t}", n.op),
            _ => n.op.clone(),
        };
        format!("rank {r}: {what}")
    };
    for (r, pg) in programs.iter().enumerate() {
        let mut prev = None;
        for (k, node) in pg.nodes.iter().enumerate() {
            if !matches!(node.op.as_str(), "nns.send" | "nns.recv" | "func.call") {
                continue;
            }
            let me = dg.add_node((r, k));
            if let Some(p) = prev {
                dg.add_edge(p, me, ());
            }
            prev = Some(me);
            let peer = match node.attrs.get("peer") {
                Some(AttrValue::Int(p)) => *p as usize,
                _ => continue,
            };
            let tag = match node.attrs.get("tag") {
                Some(AttrValue::Str(t)) => t.clone(),
                _ => continue,
            };
            if node.op == "nns.send" {
                if sends.insert((r, peer, tag.clone()), me).is_some() {
                    return Err(format!("{} is sent twice", describe(r, k)));
                }
            } else {
                recvs.push((me, peer, r, tag, k));
            }
        }
    }
    for (me, peer, r, tag, k) in recvs {
        let s = sends
            .remove(&(peer, r, tag))
            .ok_or_else(|| format!("{} has no matching send", describe(r, k)))?;
        dg.add_edge(s, me, ());
    }
    if let Some(((r, k), _)) = sends.into_iter().next().map(|(key, ix)| (dg[ix], key)) {
        return Err(format!("{} is never received", describe(r, k)));
    }
    petgraph::algo::toposort(&dg, None).map_err(|c| {
        let (r, k) = dg[c.node_id()];
        format!(
            "the schedule deadlocks: {} waits in a cycle of sends and receives",
            describe(r, k)
        )
    })?;
    Ok(())
}

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

mod build;

use crate::layouts::{error, the_mesh};
use crate::pass::{ModulePass, PassOptions};
use crate::planner::schedule::{self, Schedule, ScheduleKind};
use crate::rewrite::is_ours;
use melior::ir::OperationRef;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::types::AttrValue;
use nnscaler_dialects::verify::file_loc;
use nnscaler_dialects::view::top_level_ops;

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
    /// `chunks=`, when given.
    chunks: Option<usize>,
    axis: String,
    remarks: Diagnostics,
}

impl SchedulePass {
    /// `--schedule-<name>`: options `microbatches` (checked against the mesh), `axis` (the
    /// pipeline axis, `pp`), `chunks` (interleaved only, 2 by default; `--schedule` takes
    /// the chosen interleaved schedule's from the stages the step is placed in).
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
            chunks,
            axis: o.get("axis").unwrap_or("pp").to_string(),
            flag,
            source,
            remarks: Diagnostics::default(),
        })
    }

    /// The schedule for `p` ranks and `m` micro-batches; `chosen` is the step's
    /// `nns.schedule` (for [`Source::Chosen`]), `stages` the stages it is placed in.
    fn schedule(
        &self,
        p: usize,
        m: usize,
        chosen: Option<&str>,
        stages: usize,
    ) -> Result<Schedule, String> {
        let s = match &self.source {
            Source::Named(k) => k.make(p, m, self.chunks.unwrap_or(2))?,
            // The plan chose the chunks with the stages: a rank's share of them.
            Source::Chosen => schedule::by_name(
                chosen.ok_or("the step has no chosen schedule (nns.schedule)")?,
                p,
                m,
                self.chunks
                    .unwrap_or(if p > 0 && stages.is_multiple_of(p) && stages / p >= 2 {
                        stages / p
                    } else {
                        2
                    }),
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
                Ok(g) if !crate::transforms::recompute::has_backward(&g) => {
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
                .schedule(p, m, chosen(&g).as_deref(), build::stage_count(&g))
                .map_err(|e| error(&g.loc, format!("{flag}: {e}")))?;
            let made = build::build(&g, &mesh, &sched, &self.axis, &flag)?;
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

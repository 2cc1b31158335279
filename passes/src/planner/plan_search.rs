//! `--plan="auto cluster=... devices=N"`: the plan search ([`crate::planner::search`], the one
//! behind `nnscaler plan`) over what can be applied in place to the training step it runs
//! on: data x context x tensor x pipeline parallel factorizations of the devices (tensor
//! parallelism within the innermost network level), micro-batch size and count, the
//! pipeline schedule, the recompute policy and, for a step with optimizer state, ZeRO 0-3.
//! The fastest plan is written into the step as directives: its stages as `--place` writes
//! them on a training step (the searched cut, as a `layout=`), its recompute as
//! `--recompute` does, its mesh, splits and layouts as `--plan` does, and its schedule as
//! `nns.schedule` on the step, which `--schedule` runs; so one pass pipeline
//! (`--propagate-layouts --split-tensor --schedule --lower-relayouts --localize`) carries
//! out whatever plan was chosen. The ranking, and what was out and why (a degree the
//! compiler refuses, memory), is a remark.
//!
//! Pipelines and micro-batches are searched when the step can be placed
//! ([`crate::transforms::place::placeable`]: its backward ops carry their forward ops' locations, so in
//! the `nnscaler-opt` run that made the backward, or one that read a step printed with
//! `--mlir-print-debuginfo`), otherwise the space is one stage of one micro-batch and the
//! remark says why; `max_pp=1` keeps them out too. Recompute is searched unless the step
//! is recomputed already.
//!
//! A mesh the module declares (the axes its ops' constraints name: `nns.split`,
//! `nns.pin`, `nns.forbid`) fixes the sizes of its `dp`, `sp`, `tp` and `pp` axes (an axis
//! it lacks is 1), the micro-batches (its micro-batch axis's size, else one) and, with a
//! `memory_cap`, the memory per device, as it does for `nnscaler plan`; `devices` must be
//! its device count, and the plan is applied on it.

use crate::layouts::error;
use crate::pass::{FunctionPass, Lookup, ModulePass, PassOptions};
use crate::pipeline::Step;
use crate::planner::cost::{self, Cluster};
use crate::planner::search::{self, Estimate, Profiles, Recompute, Space};
use crate::rewrite::rewrite_funcs;
use melior::ir::OperationRef;
use nnscaler_dialects::diag::{Diagnostics, SrcLoc};
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::verify::Meshes;

/// What follows a choice's headline in its remark.
const CHOICE_DETAILS: &str = "; predicted per device:";

/// The facts ([`nnscaler_dialects::diag::Diagnostic::facts`]) of the remark announcing the
/// choice: the plan's options and the headline.
const FACT_PLAN: &str = "plan-search.plan";
const FACT_HEADLINE: &str = "plan-search.headline";

/// The plan `--plan=auto` chose: drivers that run the pass (`nnscaler train`) read it from
/// the facts of the remark announcing it ([`PlanChoice::of_remark`]), not from its wording.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanChoice {
    /// `plan: auto chose "PLAN" on N x DEVICE (CLUSTER)`: the remark's first line, less
    /// the predictions.
    pub headline: String,
    /// The chosen plan's `--plan` options.
    pub plan: String,
}

impl PlanChoice {
    /// The choice a remark of this pass reports, if `remark` is the one announcing it.
    pub fn of_remark(remark: &nnscaler_dialects::diag::Diagnostic) -> Option<PlanChoice> {
        Some(PlanChoice {
            headline: remark.facts.get(FACT_HEADLINE)?.clone(),
            plan: remark.facts.get(FACT_PLAN)?.clone(),
        })
    }

    /// The facts of the remark announcing this choice.
    fn facts(&self) -> std::collections::BTreeMap<String, String> {
        [
            (FACT_PLAN.to_string(), self.plan.clone()),
            (FACT_HEADLINE.to_string(), self.headline.clone()),
        ]
        .into_iter()
        .collect()
    }
}

/// The pass.
#[derive(Debug)]
pub struct PlanSearch {
    cluster: Cluster,
    /// The cluster as the option gave it (a preset's name or a file), for `tp-search`.
    cluster_spec: String,
    devices: i64,
    /// The largest context-parallel degree (`max_sp=`; default: the search's).
    max_sp: Option<u64>,
    /// The largest pipeline degree (`max_pp=`; 1: no pipelines nor micro-batches).
    max_pp: Option<u64>,
    /// Plans the ranking remark lists (`top=`; default: the search's 20).
    top: Option<u64>,
    /// The passes it runs, by name (the registry's).
    lookup: Lookup,
    remarks: Diagnostics,
}

impl PlanSearch {
    /// Options: `cluster` (a preset or TOML file), `devices`, and `max_sp` (the largest
    /// context-parallel degree to try); `lookup` finds the passes it runs (`place`,
    /// `recompute`, `plan`, `autodiff`, `optimizer`).
    pub fn new(o: &PassOptions, lookup: Lookup) -> Result<Self, String> {
        let cluster_spec = o
            .get("cluster")
            .ok_or("plan: auto needs cluster=PRESET|FILE (presets: dgx-a100, dgx-h100, h200, cpu)")?
            .to_string();
        let cluster = cost::load(&cluster_spec).map_err(|e| format!("plan: {e}"))?;
        let devices = o
            .positive("devices", "plan")?
            .ok_or("plan: auto needs devices=N")? as i64;
        let max_sp = o.positive("max_sp", "plan")?;
        let max_pp = o.positive("max_pp", "plan")?;
        let top = o.positive("top", "plan")?;
        for k in ["dp", "sp", "tp", "pp", "microbatches", "zero", "schedule"] {
            if o.get(k).is_some() {
                return Err(format!(
                    "plan: auto chooses '{k}' itself; give a named policy to set it"
                ));
            }
        }
        Ok(PlanSearch {
            cluster,
            cluster_spec,
            devices,
            max_sp,
            max_pp,
            top,
            lookup,
            remarks: Diagnostics::default(),
        })
    }
}

/// The schedule `--schedule` runs for plan `c` (a single stage's micro-batches: 1F1B).
impl PlanSearch {
    /// Runs function pass `name` (`place`, `recompute`) with `options` on the step
    /// `@func` of `module` only.
    fn on_step(
        &mut self,
        module: &OperationRef<'_, '_>,
        func: &str,
        name: &str,
        options: &str,
    ) -> Result<(), Diagnostics> {
        let step =
            Step::named(self.lookup, name, options).map_err(|e| error(&SrcLoc::default(), e))?;
        let mut pass: Box<dyn FunctionPass> = match name {
            "place" => Box::new(
                crate::transforms::place::Place::new(&step.options)
                    .map_err(|e| error(&SrcLoc::default(), e))?,
            ),
            _ => Box::new(
                crate::transforms::recompute::Recompute::new(&step.options)
                    .map_err(|e| error(&SrcLoc::default(), e))?,
            ),
        };
        rewrite_funcs(module, &mut |g| {
            if g.name == func {
                pass.run_on_function(g)
            } else {
                Ok(None)
            }
        })?;
        self.remarks.extend(pass.take_remarks());
        Ok(())
    }
}

impl ModulePass for PlanSearch {
    fn run(&mut self, module: &OperationRef<'_, '_>) -> Result<(), Diagnostics> {
        let mut d = Diagnostics::default();
        let meshes = Meshes::collect(module, &mut d);
        if d.has_errors() {
            return Err(d);
        }
        if meshes.0.len() > 1 {
            return Err(error(
                &SrcLoc::default(),
                "plan: the module has several meshes; only one is supported",
            ));
        }
        // A mesh the module declares (its ops' constraints name its axes) fixes the sizes
        // of its axes, the micro-batches (its micro-batch axis, else one) and, with a
        // memory_cap, the memory per device.
        let mesh = meshes.0.first().cloned();
        // The module's main function (its largest), read as plain data: the search only
        // reads it (its locations tell --place which forward op each backward op is of),
        // and the module is changed only once a plan is chosen.
        let mut g = Graph::all_in_op(module)
            .into_iter()
            .filter_map(Result::ok)
            .max_by_key(|g| g.nodes.len())
            .ok_or_else(|| error(&SrcLoc::default(), "plan: auto found no function to plan"))?;
        g.source = None;
        let training = g.args.iter().any(|a| a.attrs.contains_key("nns.state_of"));
        let mut space = Space::new(self.devices as u64);
        if let Some(m) = &mesh {
            for axis in m.axes.iter().filter(|x| !x.microbatches) {
                if !["dp", "sp", "tp", "pp"].contains(&axis.name.as_str()) {
                    return Err(error(
                        &SrcLoc::default(),
                        format!(
                            "plan: auto: mesh '@{}' has axis '{}'; auto knows dp, sp, tp and pp",
                            m.name, axis.name
                        ),
                    ));
                }
                space
                    .fixed
                    .push((axis.name.clone(), axis.size.max(1) as u64));
            }
            if m.devices() != self.devices {
                return Err(error(
                    &SrcLoc::default(),
                    format!(
                        "plan: auto: devices={} disagrees with mesh '@{}', which has {} devices",
                        self.devices,
                        m.name,
                        m.devices()
                    ),
                ));
            }
            space.microbatches = Some(m.microbatch_axis().map_or(1, |a| a.size.max(1) as u64));
            space.memory_cap = m.memory_cap.map(|c| c.max(0) as u64);
        }
        space.max_sp = self.max_sp.or(space.max_sp);
        space.max_pp = self.max_pp.or(space.max_pp);
        if let Some(t) = self.top {
            space.keep = t as usize;
        }
        space.zero = if training { vec![0, 1, 2, 3] } else { vec![0] };
        // Pipelines when the step can be placed; recompute unless it is recomputed already.
        let recomputed = g
            .nodes
            .iter()
            .any(|n| n.attrs.contains_key("nns.recompute"));
        let why_not = match crate::transforms::place::placeable(&g) {
            Err(e) => Some(format!("the step cannot be placed in stages: {e}")),
            Ok(()) if self.max_pp == Some(1) => Some("max_pp=1".to_string()),
            Ok(()) => None,
        };
        space.pipelines = why_not.is_none();
        if recomputed {
            space.recompute = vec![Recompute::None];
        }
        // Repeated layers profiled once (the step cut as `nnscaler plan` cuts a forward).
        let cut = if mesh.is_none() {
            crate::planner::layer_runs::cut_step(&g, self.lookup)
        } else {
            None
        };
        let mut profiles = Profiles::new();
        let found = search::search_with(
            &g,
            cut.as_ref(),
            &self.cluster,
            &space,
            &mut profiles,
            &mut |_| {},
        )
        .map_err(|e| error(&SrcLoc::default(), format!("plan: auto: {e}")))?;
        let plan_of = |e: &Estimate| {
            let mut p = e.config.plan_options(&self.cluster_spec);
            if e.config.pipelined() {
                p += &format!(" schedule={}", e.config.schedule_name());
            }
            if e.config.recompute != Recompute::None {
                p += &format!(", recompute={}", e.config.recompute.name());
            }
            p
        };
        let mut lines: Vec<String> = found
            .ranked
            .iter()
            .map(|e| {
                format!(
                    "{}: {:.6} s, {} bytes per device",
                    plan_of(e),
                    e.seconds,
                    e.memory
                )
            })
            .collect();
        lines.extend(found.out.iter().map(|(r, k)| format!("{k} out ({r})")));
        if let Some(why) = &why_not {
            lines.push(format!("pipelines and micro-batches not searched ({why})"));
        }
        let Some(best) = found.ranked.first() else {
            let least = found
                .least_memory
                .map(|m| match space.memory_cap {
                    Some(cap) if cap < self.cluster.device.usable_memory() => format!(
                        "; the leanest plan needs at least {m} bytes per device, the mesh's memory_cap is {cap}"
                    ),
                    _ => format!(
                        "; the leanest plan needs at least {m} bytes per device, the device has {} for it",
                        self.cluster.device.usable_memory()
                    ),
                })
                .unwrap_or_default();
            return Err(error(
                &SrcLoc::default(),
                format!(
                    "plan: auto found no plan for {} devices of {}: {}{least}",
                    self.devices,
                    self.cluster.name,
                    lines.join("; ")
                ),
            ));
        };
        let chosen = plan_of(best);
        let choice = PlanChoice {
            headline: format!(
                "plan: auto chose \"{chosen}\" on {} x {} ({})",
                self.devices, self.cluster.device.name, self.cluster.name
            ),
            plan: chosen.clone(),
        };
        self.remarks.remark_with(
            &SrcLoc::default(),
            format!(
                "{}{CHOICE_DETAILS}\n  {}",
                choice.headline,
                lines.join("\n  ")
            ),
            choice.facts(),
        );
        let c = &best.config;
        if c.pipelined() {
            // The stages: the searched cut (the profile's items, as --place lays them out).
            let stages = c.stage_starts.len();
            let layout = profiles
                .get(&search::profile_key(c))
                .and_then(|p| p.as_ref().ok())
                .and_then(|p| p.place_layout(&c.stage_starts))
                .filter(|_| stages > 1);
            let options = match layout {
                Some(l) => format!("stages={stages} layout={l}"),
                None => format!("stages={stages}"),
            };
            self.on_step(module, &g.name, "place", &options)?;
        }
        if c.recompute != Recompute::None {
            self.on_step(module, &g.name, "recompute", c.recompute.name())?;
        }
        let mut options = c.plan_options(&self.cluster_spec);
        if c.pipelined() {
            options += &format!(" schedule={}", c.schedule_name());
        }
        let step =
            Step::named(self.lookup, "plan", &options).map_err(|e| error(&SrcLoc::default(), e))?;
        let mut plan = crate::transforms::plan::Plan::new(&step.options)
            .map_err(|e| error(&SrcLoc::default(), e))?;
        plan.run(module)?;
        self.remarks.extend(plan.take_remarks());
        Ok(())
    }

    fn take_remarks(&mut self) -> Diagnostics {
        std::mem::take(&mut self.remarks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_choice_is_read_back_from_its_remark() {
        let choice = PlanChoice {
            headline: "plan: auto chose \"dp dp=2\" on 2 x H100 SXM 80GB (dgx-h100)".into(),
            plan: "dp dp=2".into(),
        };
        let mut d = Diagnostics::default();
        d.remark(&SrcLoc::default(), "plan: auto: profiling");
        d.remark_with(
            &SrcLoc::default(),
            format!("{}{CHOICE_DETAILS}\n  12.3 ms", choice.headline),
            choice.facts(),
        );
        let read: Vec<PlanChoice> = d.0.iter().filter_map(PlanChoice::of_remark).collect();
        assert_eq!(read, vec![choice]);
        // Its wording does not make a remark a choice.
        let mut w = Diagnostics::default();
        w.remark(&SrcLoc::default(), d.0[1].message.clone());
        assert_eq!(PlanChoice::of_remark(&w.0[0]), None);
    }
}

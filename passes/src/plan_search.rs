//! `--plan="auto cluster=... devices=N"`: the plan search ([`crate::search`], the one
//! behind `nnscaler plan`) restricted to what `--plan` applies in place to the module it
//! runs on: data x context x tensor parallel factorizations of the devices (tensor
//! parallelism within the innermost network level), one stage, one micro-batch, no
//! recompute, and ZeRO 0-3 for a step with optimizer state. The fastest plan is written
//! as `--plan` would write it; the ranking, and what was out and why (a degree the
//! compiler refuses, memory), is a remark. Pipelines,
//! micro-batches and recompute need passes before `--autodiff` (`--place`): `nnscaler
//! plan` searches them and prints those passes.

use crate::cost::{self, Cluster};
use crate::layouts::error;
use crate::pipeline::{ModulePass, PassOptions, Step};
use crate::search::{self, Estimate, Profiles, Recompute, Space};
use melior::ir::OperationRef;
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::diag::{Diagnostics, SrcLoc};
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::verify::Meshes;

/// The pass.
#[derive(Debug)]
pub struct PlanSearch {
    cluster: Cluster,
    /// The cluster as the option gave it (a preset's name or a file), for `tp-search`.
    cluster_spec: String,
    devices: i64,
    /// The largest context-parallel degree (`max_sp=`; default: the search's).
    max_sp: Option<u64>,
    remarks: Diagnostics,
}

impl PlanSearch {
    /// Options: `cluster` (a preset or TOML file), `devices`, and `max_sp` (the largest
    /// context-parallel degree to try).
    pub fn new(o: &PassOptions) -> Result<Self, String> {
        let cluster_spec = o
            .get("cluster")
            .ok_or("plan: auto needs cluster=PRESET|FILE (presets: dgx-a100, dgx-h100, h200, cpu)")?
            .to_string();
        let cluster = cost::load(&cluster_spec).map_err(|e| format!("plan: {e}"))?;
        let devices = o
            .get("devices")
            .ok_or("plan: auto needs devices=N")?
            .parse::<i64>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or("plan: 'devices' must be a positive integer")?;
        let max_sp = match o.get("max_sp") {
            None => None,
            Some(v) => Some(
                v.parse::<u64>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or("plan: 'max_sp' must be a positive integer")?,
            ),
        };
        for k in ["dp", "sp", "tp", "pp", "microbatches", "zero"] {
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
            remarks: Diagnostics::default(),
        })
    }
}

impl ModulePass for PlanSearch {
    fn run(&mut self, module: &OperationRef<'_, '_>) -> Result<(), Diagnostics> {
        let mut d = Diagnostics::default();
        let meshes = Meshes::collect(module, &mut d);
        if !meshes.0.is_empty() {
            return Err(error(
                &SrcLoc::default(),
                "plan: auto plans a module without a mesh; this one has one already",
            ));
        }
        // The module's main function (its largest), read on a copy.
        let text = module.to_string();
        let ir = IrContext::new();
        let m = ir
            .parse(&text, "plan-search")
            .map_err(|d| error(&SrcLoc::default(), d.to_string()))?;
        let g = Graph::all_in(&m)
            .into_iter()
            .filter_map(Result::ok)
            .max_by_key(|g| g.nodes.len())
            .ok_or_else(|| error(&SrcLoc::default(), "plan: auto found no function to plan"))?;
        let training = g.args.iter().any(|a| a.attrs.contains_key("nns.state_of"));
        // What --plan applies in place: one stage, one micro-batch, no recompute; ZeRO
        // for a step with optimizer state.
        let mut space = Space::new(self.devices as u64);
        space.pipelines = false;
        space.max_sp = self.max_sp.or(space.max_sp);
        space.recompute = vec![Recompute::None];
        space.zero = if training { vec![0, 1, 2, 3] } else { vec![0] };
        let found = search::search(&g, &self.cluster, &space, &mut Profiles::new(), &mut |_| {})
            .map_err(|e| error(&SrcLoc::default(), format!("plan: auto: {e}")))?;
        let plan_of = |e: &Estimate| e.config.plan_options(&self.cluster_spec);
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
        let Some(best) = found.ranked.first() else {
            let least = found
                .least_memory
                .map(|m| {
                    format!(
                        "; the leanest plan needs at least {m} bytes per device, the device has {}",
                        self.cluster.device.memory
                    )
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
        let best = plan_of(best);
        self.remarks.remark(
            &SrcLoc::default(),
            format!(
                "plan: auto chose \"{best}\" on {} x {} ({}); predicted per device: {}",
                self.devices,
                self.cluster.device.name,
                self.cluster.name,
                lines.join("; ")
            ),
        );
        let step = Step::new("plan", &best).map_err(|e| error(&SrcLoc::default(), e))?;
        let mut plan =
            crate::plan::Plan::new(&step.options).map_err(|e| error(&SrcLoc::default(), e))?;
        plan.run(module)?;
        self.remarks.extend(plan.take_remarks());
        Ok(())
    }

    fn take_remarks(&mut self) -> Diagnostics {
        std::mem::take(&mut self.remarks)
    }
}

//! `--plan="auto cluster=... devices=N"` (issue 14, first part): chooses the named plan the
//! cost model predicts fastest, then writes it as `--plan` would.
//!
//! The candidates are every data x tensor parallel factorization of the devices (`dp=N`,
//! `megatron tp=N`, `dp-megatron dp=d tp=t`, tensor parallelism inside one network level's
//! group, e.g. a node), each with ZeRO-1 when the step has optimizer state. Each candidate
//! is compiled for real on a copy of the module (plan, propagation, split, lowering,
//! localization) and its per-device program predicted on the cluster
//! ([`crate::cost::predict`]: ops and collectives); a candidate the passes refuse, or
//! whose parameters, optimizer state and activations do not fit a device's memory, is
//! out, with its reason in the remarks. The search is therefore exact for the model of
//! cost it uses and small: a handful of compilations. (The layer-wise Z3 search with
//! pipelines, for thousands of devices in seconds, is the next part.)

use crate::cost::{self, Cluster};
use crate::layouts::error;
use crate::pipeline::{self, ModulePass, PassOptions, Step};
use melior::ir::OperationRef;
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::diag::{Diagnostics, SrcLoc};
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::verify::Meshes;

/// The pass.
#[derive(Debug)]
pub struct PlanSearch {
    cluster: Cluster,
    devices: i64,
    remarks: Diagnostics,
}

impl PlanSearch {
    /// Options: `cluster` (a preset or TOML file) and `devices`.
    pub fn new(o: &PassOptions) -> Result<Self, String> {
        let cluster = cost::load(o.get("cluster").ok_or(
            "plan: auto needs cluster=PRESET|FILE (presets: dgx-a100, dgx-h100, h200, cpu)",
        )?)
        .map_err(|e| format!("plan: {e}"))?;
        let devices = o
            .get("devices")
            .ok_or("plan: auto needs devices=N")?
            .parse::<i64>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or("plan: 'devices' must be a positive integer")?;
        for k in ["dp", "tp", "pp", "microbatches", "zero"] {
            if o.get(k).is_some() {
                return Err(format!(
                    "plan: auto chooses '{k}' itself; give a named policy to set it"
                ));
            }
        }
        Ok(PlanSearch {
            cluster,
            devices,
            remarks: Diagnostics::default(),
        })
    }

    /// The candidate plans (pass options of `--plan`).
    fn candidates(&self, training: bool) -> Vec<String> {
        let n = self.devices;
        let inner = self.cluster.network.first().map_or(n as u64, |l| l.devices) as i64;
        let mut out = Vec::new();
        for tp in (1..=n).filter(|t| n % t == 0 && *t <= inner.max(1)) {
            let dp = n / tp;
            let base = match (dp, tp) {
                (1, 1) => continue,
                (_, 1) => format!("dp dp={dp}"),
                (1, _) => format!("megatron tp={tp}"),
                _ => format!("dp-megatron dp={dp} tp={tp}"),
            };
            if training && dp > 1 {
                out.push(format!("{base} zero=1"));
            }
            out.push(base);
        }
        if n == 1 {
            out.push("dp dp=1".into());
        }
        out
    }
}

/// A candidate's outcome: predicted seconds and bytes per device, or why it is out.
type Outcome = Result<(f64, u64), String>;

impl PlanSearch {
    /// Compiles `plan` on a copy of `text` and predicts its per-device step.
    fn evaluate(&self, text: &str, plan: &str) -> Outcome {
        let ir = IrContext::new();
        let mut m = ir.parse(text, "plan-search").map_err(|d| d.to_string())?;
        let steps: Vec<Step> = [
            ("plan", plan),
            ("propagate-layouts", ""),
            ("split-tensor", ""),
            ("lower-relayouts", ""),
            ("localize", ""),
        ]
        .iter()
        .map(|(n, o)| Step::new(n, o))
        .collect::<Result<_, _>>()?;
        pipeline::run(&ir, &mut m, &steps, &mut |_, _| {}, "plan-search").map_err(|d| {
            d.0.first()
                .map_or("the passes refused it".into(), |e| e.message.clone())
        })?;
        let mut ignored = Diagnostics::default();
        let meshes = Meshes::collect(&m.as_operation(), &mut ignored);
        let mesh = meshes.resolve(None).ok();
        let mut seconds = 0.0;
        let mut bytes = 0u64;
        for g in Graph::all_in(&m).into_iter().filter_map(Result::ok) {
            seconds += cost::predict(&g, &self.cluster, mesh).seconds();
            // What a device holds: its arguments (parameters, optimizer state, its data)
            // and every value the step makes (an upper bound on the activations alive).
            bytes += g
                .args
                .iter()
                .map(|a| g.values[a.value].bytes())
                .sum::<u64>();
            bytes += g
                .nodes
                .iter()
                .flat_map(|n| &n.outputs)
                .map(|&v| g.values[v].bytes())
                .sum::<u64>();
        }
        if bytes > self.cluster.device.memory {
            return Err(format!(
                "needs {bytes} bytes per device, the device has {}",
                self.cluster.device.memory
            ));
        }
        Ok((seconds, bytes))
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
        let text = module.to_string();
        let training = text.contains("nns.state_of");
        let mut ranked: Vec<(String, Outcome)> = self
            .candidates(training)
            .into_iter()
            .map(|c| {
                let r = self.evaluate(&text, &c);
                (c, r)
            })
            .collect();
        ranked.sort_by(|a, b| match (&a.1, &b.1) {
            (Ok(x), Ok(y)) => x.0.total_cmp(&y.0),
            (Ok(_), Err(_)) => std::cmp::Ordering::Less,
            (Err(_), Ok(_)) => std::cmp::Ordering::Greater,
            _ => std::cmp::Ordering::Equal,
        });
        let lines: Vec<String> = ranked
            .iter()
            .map(|(c, r)| match r {
                Ok((s, b)) => format!("{c}: {:.6} s, {b} bytes per device", s),
                Err(e) => format!("{c}: out ({e})"),
            })
            .collect();
        let Some((best, Ok(_))) = ranked.first() else {
            return Err(error(
                &SrcLoc::default(),
                format!(
                    "plan: auto found no plan for {} devices of {}: {}",
                    self.devices,
                    self.cluster.name,
                    lines.join("; ")
                ),
            ));
        };
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
        let step = Step::new("plan", best).map_err(|e| error(&SrcLoc::default(), e))?;
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

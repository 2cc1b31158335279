//! The predicted timeline of a pipelined program (the per-rank programs a `--schedule-*`
//! pass writes, after `--localize`): the schedule its ranks record, each fragment
//! predicted by the cost model on one device ([`crate::planner::cost::predict`], its collectives
//! included), each `nns.send` after a fragment at the latency and bandwidth of the
//! network level between the two ranks' devices ([`Cluster::p2p_time`], added to the
//! fragment that sends, as the plan search adds it), and each rank's own ops outside the
//! fragments (accumulating the micro-batches, the gradient synchronisation, the
//! optimizer) after the pipeline. Shared by `nnscaler schedule-report --program
//! --cluster` and `--print-stats=cluster=...` on a rank's program.

use crate::planner::cost::{self, Cluster};
use crate::planner::schedule::{self, Action, Kind, Schedule, Timeline};
use nnscaler_dialects::graph::{Graph, ValueId};
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::types::AttrValue;
use std::collections::HashMap;

/// The ranks' programs of pipeline `name` among `graphs`, by rank.
pub fn ranks<'g>(graphs: &'g [Graph], name: &str) -> Vec<&'g Graph> {
    let mut v: Vec<(i64, &Graph)> = graphs
        .iter()
        .filter(|g| g.func_attrs.get("nns.pipeline") == Some(&AttrValue::Str(name.into())))
        .filter_map(|g| match g.func_attrs.get("nns.pipeline_rank") {
            Some(AttrValue::Int(r)) => Some((*r, g)),
            _ => None,
        })
        .collect();
    v.sort_by_key(|(r, _)| *r);
    v.into_iter().map(|(_, g)| g).collect()
}

/// The first pipeline among `graphs` (functions with `nns.pipeline`,
/// `nns.pipeline_rank` and `nns.schedule`), by name: its name and the schedule its ranks
/// record ([`schedule_of`]). `file` names the source in errors.
pub fn recorded_schedule(graphs: &[Graph], file: &str) -> Result<(String, Schedule), String> {
    let name = graphs
        .iter()
        .filter(|g| g.func_attrs.contains_key("nns.schedule"))
        .filter_map(|g| match g.func_attrs.get("nns.pipeline") {
            Some(AttrValue::Str(p)) => Some(p.clone()),
            _ => None,
        })
        .min()
        .ok_or_else(|| {
            format!(
                "{file}: no pipelined program (functions with nns.pipeline, made by a --schedule-* pass)"
            )
        })?;
    let s = schedule_of(graphs, &name, file)?;
    Ok((name, s))
}

/// The schedule the ranks' programs of pipeline `name` record (`nns.schedule`, one line
/// of actions per rank; verified when simulated).
pub fn schedule_of(graphs: &[Graph], name: &str, file: &str) -> Result<Schedule, String> {
    let recorded: Vec<&str> = ranks(graphs, name)
        .into_iter()
        .filter_map(|g| match g.func_attrs.get("nns.schedule") {
            Some(AttrValue::Str(s)) => Some(s.as_str()),
            _ => None,
        })
        .collect();
    let Some(first) = recorded.first() else {
        return Err(format!("{file}: pipeline @{name} records no schedule"));
    };
    let sched_name = first.split(':').next().unwrap_or("").to_string();
    let table: String = recorded
        .iter()
        .map(|s| format!("{}\n", s.split_once(':').map_or(*s, |x| x.1).trim()))
        .collect();
    let mut s = schedule::parse_text(&table, file)?;
    s.name = format!("@{name} ({sched_name})");
    Ok(s)
}

/// A pipelined program's predicted step on one cluster.
#[derive(Clone, Debug)]
pub struct PipelinePrediction {
    /// The schedule the ranks record.
    pub schedule: Schedule,
    /// Its simulated timeline (fragments with their sends).
    pub timeline: Timeline,
    /// Per stage, the predicted seconds of one device's F, B and W fragment.
    pub fragments: Vec<[f64; 3]>,
    /// Per stage, the seconds of the sends after its F, B and W fragments.
    pub sends: Vec<[f64; 3]>,
    /// Per rank, the seconds of its own ops outside the fragments.
    pub own: Vec<f64>,
    /// Per rank, one device's FLOPs in a step (its fragments' for every micro-batch and
    /// its own ops').
    pub flops: Vec<f64>,
    /// Whether the fragments' matrix products run in bf16 (MFU against the bf16 peak).
    pub bf16: bool,
}

impl PipelinePrediction {
    /// The step: the pipeline, then the slowest rank's own ops.
    pub fn step(&self) -> f64 {
        self.timeline.makespan + self.own.iter().copied().fold(0.0, f64::max)
    }

    /// Model FLOPs utilization of a device of `c` over the step (every rank's FLOPs over
    /// the ranks' time at the peak: the bf16 one when the products run in bf16 and `c`
    /// has one).
    pub fn mfu(&self, c: &Cluster) -> f64 {
        let total: f64 = self.flops.iter().sum();
        total / (self.flops.len().max(1) as f64 * self.step() * c.device.matrix_rate(self.bf16))
    }
}

/// The predicted step of localized pipeline `name` among `graphs` (its ranks'
/// programs, recording schedule `s`, and its fragments `@<name>.s<stage>.<F|B|W>`) on
/// devices of `c`, devices numbered row-major over `mesh`.
pub fn predict_pipeline(
    graphs: &[Graph],
    name: &str,
    s: &Schedule,
    c: &Cluster,
    mesh: &Mesh,
) -> Result<PipelinePrediction, String> {
    let fragment = |st: usize, kind: &str| {
        let want = format!("{name}.s{st}.{kind}");
        graphs.iter().find(|g| g.name == want)
    };
    if let Some(g) = fragment(0, "F").filter(|g| !g.is_localized()) {
        return Err(format!(
            "@{}: the cost model predicts each device's ops, but @{name}'s fragments are not localized (run --lower-relayouts --localize after the --schedule-* pass)",
            g.name
        ));
    }
    let mut fragments = vec![[0.0f64; 3]; s.stages];
    let mut fragment_flops = vec![[0.0f64; 3]; s.stages];
    let mut bf16 = false;
    for (st, (row, fl)) in fragments.iter_mut().zip(&mut fragment_flops).enumerate() {
        for (k, kind) in ["F", "B", "W"].iter().enumerate() {
            if let Some(g) = fragment(st, kind) {
                let p = cost::predict(g, c, Some(mesh));
                row[k] = p.seconds();
                fl[k] = p.flops;
                bf16 |= p.bf16;
            }
        }
    }
    let ranks = ranks(graphs, name);
    let devices: Vec<&nnscaler_dialects::nns::Axis> =
        mesh.axes.iter().filter(|x| !x.microbatches).collect();
    let mut sends = vec![[0.0f64; 3]; s.stages];
    let mut own = Vec::with_capacity(ranks.len());
    let mut flops = Vec::with_capacity(ranks.len());
    for (rank, g) in ranks.iter().enumerate() {
        // The fragment (stage, kind, micro-batch) each value comes from: a call's
        // results, and what ops after it compute from them.
        let mut from: HashMap<ValueId, Action> = HashMap::new();
        let (mut seconds, mut work) = (0.0, 0.0);
        // The fragments' compute, since the rank's own collectives (the gradient sync)
        // wait for the slowest of a group that has not met since the step began.
        let mut drift = cost::Drift::default();
        for n in &g.nodes {
            if n.op == "func.call" {
                if let Some(AttrValue::Str(t)) = n.attrs.get("nns.fragment") {
                    if let Some(f) = Action::parse(t) {
                        work += fragment_flops
                            .get(f.stage)
                            .map_or(0.0, |x| x[f.kind as usize]);
                        drift.compute(fragments.get(f.stage).map_or(0.0, |x| x[f.kind as usize]));
                        for &o in &n.outputs {
                            from.insert(o, f);
                        }
                    }
                }
                continue;
            }
            let origin = n.inputs.iter().find_map(|i| from.get(i)).copied();
            if n.op == "nns.send" {
                let (Some(&v), Some(AttrValue::Int(peer)), Some(AttrValue::Str(axis))) =
                    (n.inputs.first(), n.attrs.get("peer"), n.attrs.get("axis"))
                else {
                    continue;
                };
                // Micro-batch 0's sends (every micro-batch sends the same).
                let Some(Action { stage, kind, mb: 0 }) = origin.filter(|o| o.stage < s.stages)
                else {
                    continue;
                };
                // Pipeline ranks are the devices' outermost axis of those it precedes:
                // `stride` device numbers apart.
                let stride: u64 = devices.iter().position(|x| &x.name == axis).map_or(1, |i| {
                    devices[i + 1..].iter().map(|x| x.size as u64).product()
                });
                let span = (*peer - rank as i64).unsigned_abs() * stride + 1;
                sends[stage][kind as usize] += c.p2p_time(span, g.values[v].bytes());
                continue;
            }
            if let Some(f) = origin {
                for &o in &n.outputs {
                    from.insert(o, f);
                }
            }
            if matches!(n.op.as_str(), "nns.recv" | "nns.microbatch") {
                continue;
            }
            if let Some(cost) = cost::node_cost(g, n, c, Some(mesh)) {
                seconds += drift.charge(&c.device, &cost);
                work += cost.flops;
            }
        }
        own.push(seconds);
        flops.push(work);
    }
    let cost = |a: Action| -> f64 {
        let (f, x) = (fragments[a.stage], sends[a.stage]);
        let (work, send) = match a.kind {
            Kind::F => (f[0], x[0]),
            Kind::B if s.split_backward => (f[1], x[1]),
            Kind::B => (f[1] + f[2], x[1] + x[2]),
            Kind::W => (f[2], x[2]),
        };
        work + send + receive_wait(&c.device, a, &s.device_of, work)
    };
    let timeline = schedule::simulate_with(s, &cost)?;
    Ok(PipelinePrediction {
        schedule: s.clone(),
        timeline,
        fragments,
        sends,
        own,
        flops,
        bf16,
    })
}

/// The expected wait of fragment `a` of `work` seconds for its sender's drift
/// ([`cost::Drift`]): a forward receives from the stage before it, a backward from the
/// stage after, when that stage is on another device (`device_of`, per stage); the two
/// last met a fragment's compute before. The schedule simulator has the planned waits.
pub fn receive_wait(d: &cost::Device, a: Action, device_of: &[usize], work: f64) -> f64 {
    let from = match a.kind {
        Kind::F if a.stage > 0 => a.stage - 1,
        Kind::B if a.stage + 1 < device_of.len() => a.stage + 1,
        _ => return 0.0,
    };
    if device_of.get(from) == device_of.get(a.stage) {
        return 0.0;
    }
    d.skew(2, work)
}

/// The lines `schedule-report --program --cluster` prints after the timeline's report:
/// each stage's fragments and sends, each rank's own ops, and the step.
pub fn describe(p: &PipelinePrediction, c: &Cluster) -> String {
    let ms = |x: f64| x * 1e3;
    let split = p.schedule.split_backward;
    let mut out = format!(
        "fragment times predicted on a device of {} (the cost model, collectives included); each send after its fragment at the network level between the two ranks' devices\n",
        c.device.name
    );
    for (st, ([f, b, w], [sf, sb, sw])) in p.fragments.iter().zip(&p.sends).enumerate() {
        let wpart = if split {
            format!(", W {:.3} ms", ms(*w))
        } else {
            String::new()
        };
        out += &format!(
            "  stage {st}: F {:.3} ms, B {:.3} ms{wpart}; sends {:.3} ms after F, {:.3} ms after B{}\n",
            ms(*f),
            ms(*b),
            ms(*sf),
            ms(sb + sw),
            if split { " and W" } else { "" }
        );
    }
    for (r, x) in p.own.iter().enumerate() {
        out += &format!(
            "  rank {r}: {:.3} ms of its own ops outside the fragments (micro-batch accumulation, gradient synchronisation, optimizer)\n",
            ms(*x)
        );
    }
    out += &format!(
        "predicted step: {:.3} ms (the pipeline's {:.3} ms, then the slowest rank's own ops, {:.3} ms)\n",
        ms(p.step()),
        ms(p.timeline.makespan),
        ms(p.step() - p.timeline.makespan)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragments_wait_for_a_sender_on_another_device() {
        let mut d = cost::preset("cpu").unwrap().device;
        d.sync_jitter = 1e-3;
        let at = |stage, kind| Action { stage, kind, mb: 0 };
        let wait = d.skew(2, 4e-3);
        assert!(wait > 0.0);
        // Four stages on two devices (1F1B's s mod p) and on V (0, 1, 1, 0).
        let rows = [0, 1, 0, 1];
        let v = [0, 1, 1, 0];
        assert_eq!(receive_wait(&d, at(0, Kind::F), &rows, 4e-3), 0.0);
        assert_eq!(receive_wait(&d, at(1, Kind::F), &rows, 4e-3), wait);
        assert_eq!(receive_wait(&d, at(3, Kind::B), &rows, 4e-3), 0.0);
        assert_eq!(receive_wait(&d, at(2, Kind::B), &rows, 4e-3), wait);
        assert_eq!(receive_wait(&d, at(2, Kind::W), &rows, 4e-3), 0.0);
        // V's middle stages share a device: no message between them.
        assert_eq!(receive_wait(&d, at(2, Kind::F), &v, 4e-3), 0.0);
        assert_eq!(receive_wait(&d, at(1, Kind::B), &v, 4e-3), 0.0);
        assert_eq!(receive_wait(&d, at(3, Kind::F), &v, 4e-3), wait);
        d.sync_jitter = 0.0;
        assert_eq!(receive_wait(&d, at(1, Kind::F), &rows, 4e-3), 0.0);
    }
}

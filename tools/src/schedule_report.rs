//! `nnscaler schedule-report`: a pipeline schedule's timeline, simulated.

use crate::output::Outputs;
use crate::read_input;
use nnscaler_dialects::graph::{Graph, ValueId};
use nnscaler_dialects::types::AttrValue;
use nnscaler_passes::cost::{self, Cluster};
use nnscaler_passes::schedule::{self, Costs, Kind, Schedule};
use std::collections::HashMap;

/// `nnscaler schedule-report`'s command line.
#[derive(clap::Args, Debug)]
#[command(
    about = "Simulate a pipeline schedule: per-device busy and idle time, bubble ratio, peak in-flight micro-batches, an SVG Gantt chart",
    long_about = "Simulate a pipeline schedule: per-device busy and idle time, bubble ratio, \
        peak in-flight micro-batches, and optionally an SVG Gantt chart (devices as rows, F / B / \
        W coloured, micro-batch numbers in the boxes) and the schedule as a table.\n\n\
        The schedule is generated (--schedule with --stages and --microbatches, and --chunks \
        for interleaved) or read from a table (--from FILE: one line per device, actions \
        <stage><F|B|W><micro-batch> separated by spaces, e.g. '0F0 0F1 0B0'). It is verified \
        first: every micro-batch runs F, B (and W when the backward is split) once on every \
        stage, each stage on its device, and the order cannot deadlock. Costs are per stage \
        (a chunk of an interleaved device costs 1/chunks of them); communication takes no \
        time. Files are written only when everything succeeded."
)]
pub struct ScheduleArgs {
    /// gpipe | 1f1b | interleaved | zb-h1 | zb-v.
    #[arg(
        long,
        value_name = "NAME",
        required_unless_present_any = ["from", "program"],
        conflicts_with_all = ["from", "program"]
    )]
    pub schedule: Option<String>,
    /// A schedule table to read instead.
    #[arg(long, value_name = "FILE", conflicts_with = "program")]
    pub from: Option<String>,
    /// A pipelined program (the output of a --schedule-* pass, before or after
    /// --localize) to read instead: its ranks' orders, and each fragment's time from its
    /// FLOPs (per device once localized) at --flops, or predicted by the cost model for
    /// --cluster.
    #[arg(long, value_name = "FILE.mlir")]
    pub program: Option<String>,
    /// A device's speed for --program, FLOP/s (default 1e14).
    #[arg(long, value_name = "F", conflicts_with = "cluster")]
    pub flops: Option<f64>,
    /// For a localized --program: each fragment's time predicted by the cost model on a
    /// device of CLUSTER (a preset such as dgx-h100, or a TOML file such as `nnscaler
    /// calibrate` writes), its collectives included; each send after a fragment at the
    /// latency and bandwidth of the network level between the two ranks' devices (added
    /// to the fragment that sends); and the rank's own ops outside the fragments
    /// (accumulating the micro-batches, the gradient synchronisation, the optimizer)
    /// after the pipeline.
    #[arg(long, value_name = "CLUSTER", requires = "program")]
    pub cluster: Option<String>,
    /// Pipeline devices (one stage each; `chunks` each when interleaved).
    #[arg(long, value_name = "P", default_value_t = 4)]
    pub stages: usize,
    /// Micro-batches.
    #[arg(long, value_name = "M", default_value_t = 8)]
    pub microbatches: usize,
    /// Chunks per device (interleaved).
    #[arg(long, value_name = "V", default_value_t = 2)]
    pub chunks: usize,
    /// Forward time of one stage.
    #[arg(long, value_name = "T", default_value_t = 1.0)]
    pub tf: f64,
    /// Input-gradient backward time of one stage.
    #[arg(long, value_name = "T", default_value_t = 1.0)]
    pub tb: f64,
    /// Weight-gradient backward time of one stage (part of B when the backward is not split).
    #[arg(long, value_name = "T", default_value_t = 1.0)]
    pub tw: f64,
    /// Write the Gantt chart here (SVG).
    #[arg(long, value_name = "FILE")]
    pub svg: Option<String>,
    /// Write the schedule as a table here (`-` for stdout, after the report).
    #[arg(long, value_name = "FILE")]
    pub table: Option<String>,
}

/// Runs the command; returns the report.
pub fn main(a: &ScheduleArgs) -> Result<String, String> {
    if let Some(p) = &a.program {
        return program_report(a, p);
    }
    let s = match (&a.schedule, &a.from) {
        (_, Some(f)) => schedule::parse_text(&read_input(f)?, f)?,
        (Some(name), None) => schedule::by_name(name, a.stages, a.microbatches, a.chunks)?,
        (None, None) => return Err("give --schedule NAME or --from FILE".into()),
    };
    for (k, v) in [("--tf", a.tf), ("--tb", a.tb), ("--tw", a.tw)] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(format!("{k} must be a time >= 0, not {v}"));
        }
    }
    let t = schedule::simulate(
        &s,
        Costs {
            f: a.tf,
            b: a.tb,
            w: a.tw,
        },
    )?;
    let mut report = schedule::report(&s, &t);
    let mut outputs = Outputs::new();
    if let Some(path) = &a.svg {
        outputs.stage(path, schedule::svg(&s, &t).into_bytes())?;
    }
    match a.table.as_deref() {
        Some("-") => report.push_str(&schedule::to_text(&s)),
        Some(path) => outputs.stage(path, schedule::to_text(&s).into_bytes())?,
        None => {}
    }
    outputs.commit()?;
    Ok(report)
}

/// The timeline of a pipelined program: the schedule its ranks' programs record
/// (`nns.schedule`), each fragment's time its FLOPs at `--flops`.
fn program_report(a: &ScheduleArgs, path: &str) -> Result<String, String> {
    use nnscaler_dialects::context::IrContext;
    let speed = a.flops.unwrap_or(1e14);
    if !(speed.is_finite() && speed > 0.0) {
        return Err(format!("--flops must be a speed > 0, not {speed}"));
    }
    let cluster = a.cluster.as_deref().map(cost::load).transpose()?;
    let text = read_input(path)?;
    let ir = IrContext::new();
    let module = ir
        .parse(&text, path)
        .map_err(|d| d.in_file(path).render_limited(Some(&text), 20))?;
    let graphs: Vec<Graph> = Graph::all_in(&module)
        .into_iter()
        .filter_map(Result::ok)
        .collect();
    let mut ranks: Vec<(i64, String, String)> = Vec::new();
    for g in &graphs {
        if let (Some(AttrValue::Str(p)), Some(AttrValue::Int(r)), Some(AttrValue::Str(s))) = (
            g.func_attrs.get("nns.pipeline"),
            g.func_attrs.get("nns.pipeline_rank"),
            g.func_attrs.get("nns.schedule"),
        ) {
            ranks.push((*r, p.clone(), s.clone()));
        }
    }
    if ranks.is_empty() {
        return Err(format!(
            "{path}: no pipelined program (functions with nns.pipeline, made by a --schedule-* pass)"
        ));
    }
    ranks.sort();
    let name = ranks[0].1.clone();
    let sched_name = ranks[0].2.split(':').next().unwrap_or("").to_string();
    let table: String = ranks
        .iter()
        .map(|(_, _, s)| format!("{}\n", s.split_once(':').map_or(s.as_str(), |x| x.1).trim()))
        .collect();
    let mut s = schedule::parse_text(&table, path)?;
    s.name = format!("@{name} ({sched_name})");
    // Each fragment's FLOPs: @<name>.s<stage>.<F|B|W>.
    let flops = |stage: usize, kind: &str| -> f64 {
        graphs
            .iter()
            .find(|g| g.name == format!("{name}.s{stage}.{kind}"))
            .map_or(0.0, |g| {
                g.nodes
                    .iter()
                    .map(|n| nnscaler_passes::place::op_flops(g, n))
                    .sum()
            })
    };
    // Before --localize a fragment's FLOPs are the whole batch's on all the stage's
    // devices: one micro-batch on one device is 1/(m x devices per stage) of that (an even
    // split); after, they are exactly one device's.
    let localized = graphs
        .iter()
        .any(|g| g.name == format!("{name}.s0.F") && g.is_localized());
    if let Some(c) = &cluster {
        if !localized {
            return Err(format!(
                "{path}: --cluster predicts each device's ops, but @{name}'s fragments are not localized (run --lower-relayouts --localize after the --schedule-* pass)"
            ));
        }
        return predicted_report(a, (&s, &graphs, &module), &name, c);
    }
    let share = if localized {
        1.0
    } else {
        let mut d = Default::default();
        let meshes = nnscaler_dialects::verify::Meshes::collect(&module.as_operation(), &mut d);
        let per_stage = meshes
            .resolve(None)
            .map(|m| (m.devices() / s.devices.max(1) as i64).max(1))
            .unwrap_or(1);
        1.0 / (s.microbatches as f64 * per_stage as f64)
    };
    let mut per: Vec<[f64; 3]> = Vec::new();
    for st in 0..s.stages {
        per.push([
            flops(st, "F") * share,
            flops(st, "B") * share,
            flops(st, "W") * share,
        ]);
    }
    let cost = |x: schedule::Action| -> f64 {
        let [f, b, w] = per[x.stage];
        (match x.kind {
            schedule::Kind::F => f,
            schedule::Kind::B if s.split_backward => b,
            schedule::Kind::B => b + w,
            schedule::Kind::W => w,
        }) / speed
    };
    let t = schedule::simulate_with(&s, &cost)?;
    let mut report = schedule::report_scaled(&s, &t, 1e3, "ms");
    report.push_str(&format!(
        "fragment times at {:.3e} FLOP/s per device{}; sends and receives take no time\n",
        speed,
        if localized {
            ""
        } else {
            " (not localized: each fragment's FLOPs split evenly over micro-batches and the stage's devices; run after --localize for each device's exact work)"
        }
    ));
    for (st, [f, b, w]) in per.iter().enumerate() {
        report.push_str(&format!(
            "  stage {st}: F {:.3} ms, B {:.3} ms{}\n",
            f / speed * 1e3,
            b / speed * 1e3,
            if s.split_backward {
                format!(", W {:.3} ms", w / speed * 1e3)
            } else {
                String::new()
            }
        ));
    }
    let mut outputs = Outputs::new();
    if let Some(p) = &a.svg {
        outputs.stage(p, schedule::svg(&s, &t).into_bytes())?;
    }
    match a.table.as_deref() {
        Some("-") => report.push_str(&schedule::to_text(&s)),
        Some(p) => outputs.stage(p, schedule::to_text(&s).into_bytes())?,
        None => {}
    }
    outputs.commit()?;
    Ok(report)
}

/// `--program` with `--cluster`: the timeline of localized pipelined program `name`
/// (schedule `s`, functions `graphs` of `module`), each fragment predicted by the cost
/// model on a device of `c`, with its sends; then the ranks' own ops.
fn predicted_report(
    a: &ScheduleArgs,
    (s, graphs, module): (&Schedule, &[Graph], &melior::ir::Module<'_>),
    name: &str,
    c: &Cluster,
) -> Result<String, String> {
    let mut d = Default::default();
    let meshes = nnscaler_dialects::verify::Meshes::collect(&module.as_operation(), &mut d);
    let mesh = meshes.resolve(None)?;
    let kind_index = |k: char| match k {
        'F' => Some(0),
        'B' => Some(1),
        'W' => Some(2),
        _ => None,
    };
    // Each fragment's predicted seconds on one device: [F, B, W] per stage.
    let mut per = vec![[0.0f64; 3]; s.stages];
    for (st, row) in per.iter_mut().enumerate() {
        for (k, kind) in ["F", "B", "W"].iter().enumerate() {
            if let Some(g) = graphs
                .iter()
                .find(|g| g.name == format!("{name}.s{st}.{kind}"))
            {
                row[k] = cost::predict(g, c, Some(mesh)).seconds();
            }
        }
    }
    // Sends after each stage's fragments (micro-batch 0's, as every micro-batch sends
    // the same), and each rank's own ops outside the fragments.
    let mut sends = vec![[0.0f64; 3]; s.stages];
    let mut own = Vec::new();
    let ranks: Vec<&Graph> = {
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
    };
    let devices: Vec<&nnscaler_dialects::nns::Axis> =
        mesh.axes.iter().filter(|x| !x.microbatches).collect();
    for (rank, g) in ranks.iter().enumerate() {
        // The fragment (stage, kind, micro-batch) each value comes from: a call's results,
        // and what ops after it compute from them.
        let mut from: HashMap<ValueId, (usize, usize, usize)> = HashMap::new();
        let mut seconds = 0.0;
        for n in &g.nodes {
            let tag = match n.attrs.get("nns.fragment") {
                Some(AttrValue::Str(t)) => Some(t.clone()),
                _ => None,
            };
            if let (Some(t), "func.call") = (&tag, n.op.as_str()) {
                let frag = parse_fragment(t, &kind_index);
                if let Some(f) = frag {
                    for &o in &n.outputs {
                        from.insert(o, f);
                    }
                }
                continue;
            }
            if n.op == "nns.send" {
                let (Some(&v), Some(AttrValue::Int(peer)), Some(AttrValue::Str(axis))) =
                    (n.inputs.first(), n.attrs.get("peer"), n.attrs.get("axis"))
                else {
                    continue;
                };
                let Some(&(st, k, mb)) = from.get(&v) else {
                    continue;
                };
                if mb != 0 || st >= s.stages {
                    continue;
                }
                // Devices are numbered row-major with the pipeline axis outermost of the
                // axes it precedes: ranks `stride` device numbers apart.
                let at = devices.iter().position(|x| &x.name == axis);
                let stride: u64 = at.map_or(1, |i| {
                    devices[i + 1..].iter().map(|x| x.size as u64).product()
                });
                let span = (*peer - rank as i64).unsigned_abs() * stride + 1;
                sends[st][k] += c.p2p_time(span, g.values[v].bytes());
                continue;
            }
            if matches!(n.op.as_str(), "nns.recv" | "nns.microbatch" | "func.call") {
                if let Some(&f) = n.inputs.iter().find_map(|i| from.get(i)) {
                    for &o in &n.outputs {
                        from.insert(o, f);
                    }
                }
                continue;
            }
            if let Some(&f) = n.inputs.iter().find_map(|i| from.get(i)) {
                for &o in &n.outputs {
                    from.insert(o, f);
                }
            }
            if let Some(cost) = cost::node_cost(g, n, c, Some(mesh)) {
                seconds += cost.seconds;
            }
        }
        own.push(seconds);
    }
    let cost = |x: schedule::Action| -> f64 {
        let (f, b, w) = (per[x.stage], sends[x.stage], x.kind);
        match w {
            Kind::F => f[0] + b[0],
            Kind::B if s.split_backward => f[1] + b[1],
            Kind::B => f[1] + f[2] + b[1] + b[2],
            Kind::W => f[2] + b[2],
        }
    };
    let t = schedule::simulate_with(s, &cost)?;
    let mut report = schedule::report_scaled(s, &t, 1e3, "ms");
    report.push_str(&format!(
        "fragment times predicted on a device of {} (the cost model, collectives included); each send after its fragment at the network level between the two ranks' devices\n",
        c.device.name
    ));
    let ms = |x: f64| x * 1e3;
    for (st, ([f, b, w], [sf, sb, sw])) in per.iter().zip(&sends).enumerate() {
        let split = if s.split_backward {
            format!(", W {:.3} ms", ms(*w))
        } else {
            String::new()
        };
        report.push_str(&format!(
            "  stage {st}: F {:.3} ms, B {:.3} ms{split}; sends {:.3} ms after F, {:.3} ms after B{}\n",
            ms(*f),
            ms(*b),
            ms(*sf),
            ms(sb + sw),
            if s.split_backward { " and W" } else { "" }
        ));
    }
    let last = own.iter().copied().fold(0.0, f64::max);
    for (r, x) in own.iter().enumerate() {
        report.push_str(&format!(
            "  rank {r}: {:.3} ms of its own ops outside the fragments (micro-batch accumulation, gradient synchronisation, optimizer)\n",
            ms(*x)
        ));
    }
    report.push_str(&format!(
        "predicted step: {:.3} ms (the pipeline's {:.3} ms, then the slowest rank's own ops, {:.3} ms)\n",
        ms(t.makespan + last),
        ms(t.makespan),
        ms(last)
    ));
    let mut outputs = Outputs::new();
    if let Some(p) = &a.svg {
        outputs.stage(p, schedule::svg(s, &t).into_bytes())?;
    }
    match a.table.as_deref() {
        Some("-") => report.push_str(&schedule::to_text(s)),
        Some(p) => outputs.stage(p, schedule::to_text(s).into_bytes())?,
        None => {}
    }
    outputs.commit()?;
    Ok(report)
}

/// `(stage, kind index, micro-batch)` of a fragment tag such as `1B3`.
fn parse_fragment(
    t: &str,
    kind_index: &dyn Fn(char) -> Option<usize>,
) -> Option<(usize, usize, usize)> {
    let at = t.find(|ch: char| !ch.is_ascii_digit())?;
    let stage = t[..at].parse().ok()?;
    let kind = kind_index(t[at..].chars().next()?)?;
    let mb = t[at + 1..].parse().ok()?;
    Some((stage, kind, mb))
}

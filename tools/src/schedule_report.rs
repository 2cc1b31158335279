//! `nnscaler schedule-report`: a pipeline schedule's timeline, simulated.

use crate::output::Outputs;
use crate::read_input;
use nnscaler_dialects::graph::Graph;
use nnscaler_passes::planner::cost;
use nnscaler_passes::planner::schedule::{self, Costs, Schedule, Timeline};
use nnscaler_passes::planner::timeline;

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
        time.\n\n\
        --program reads a pipelined program instead: its ranks' recorded orders, each \
        fragment's FLOPs at --flops, or with --cluster (after --localize) each fragment, \
        its sends and the ranks' own ops predicted by the cost model, as \
        --print-stats=cluster=... predicts them. Files are written only when everything \
        succeeded."
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
        outputs.stage(path, schedule::svg(&s, &t, 1.0, "").into_bytes())?;
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
    let (name, s) = timeline::recorded_schedule(&graphs, path)?;
    // Each fragment's FLOPs: @<name>.s<stage>.<F|B|W>.
    let flops = |stage: usize, kind: &str| -> f64 {
        graphs
            .iter()
            .find(|g| g.name == format!("{name}.s{stage}.{kind}"))
            .map_or(0.0, |g| {
                g.nodes
                    .iter()
                    .map(|n| nnscaler_passes::transforms::place::op_flops(g, n))
                    .sum()
            })
    };
    // Before --localize a fragment's FLOPs are the whole batch's on all the stage's
    // devices: one micro-batch on one device is 1/(m x devices per stage) of that (an even
    // split); after, they are exactly one device's.
    let localized = graphs
        .iter()
        .any(|g| g.name == format!("{name}.s0.F") && g.is_localized());
    let mut d = Default::default();
    let meshes = nnscaler_dialects::verify::Meshes::collect(&module.as_operation(), &mut d);
    if let Some(c) = &cluster {
        let mesh = meshes.resolve(None)?;
        let p = timeline::predict_pipeline(&graphs, &name, &s, c, mesh)
            .map_err(|e| format!("{path}: {e}"))?;
        let mut report = schedule::report_scaled(&s, &p.timeline, 1e3, "ms");
        report.push_str(&timeline::describe(&p, c));
        return finish(a, &s, &p.timeline, report);
    }
    let share = if localized {
        1.0
    } else {
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
    finish(a, &s, &t, report)
}

/// Writes the chart and table `a` asks for (all or nothing) and returns the report, the
/// table appended for `--table -`.
fn finish(
    a: &ScheduleArgs,
    s: &Schedule,
    t: &Timeline,
    mut report: String,
) -> Result<String, String> {
    let mut outputs = Outputs::new();
    if let Some(p) = &a.svg {
        outputs.stage(p, schedule::svg(s, t, 1e3, "ms").into_bytes())?;
    }
    match a.table.as_deref() {
        Some("-") => report.push_str(&schedule::to_text(s)),
        Some(p) => outputs.stage(p, schedule::to_text(s).into_bytes())?,
        None => {}
    }
    outputs.commit()?;
    Ok(report)
}

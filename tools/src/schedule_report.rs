//! `nnscaler schedule-report`: a pipeline schedule's timeline, simulated.

use crate::output::Outputs;
use crate::read_input;
use nnscaler_passes::schedule::{self, Costs};

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
    /// gpipe | 1f1b | interleaved | zb-h1.
    #[arg(
        long,
        value_name = "NAME",
        required_unless_present = "from",
        conflicts_with = "from"
    )]
    pub schedule: Option<String>,
    /// A schedule table to read instead.
    #[arg(long, value_name = "FILE")]
    pub from: Option<String>,
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

//! `nnscaler plan`: searches data x tensor x pipeline parallelism, micro-batching, the
//! schedule, recompute and ZeRO for a model on a cluster ([`nnscaler_passes::planner::search`]),
//! prints the chosen plan with its predicted step time, MFU, memory per device and the
//! next best plans with why they lost, optionally beside the best plan of a Megatron-LM
//! grid scored by the same model, and the `nnscaler-opt` flags that apply it.

use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::verify::Meshes;
use nnscaler_frontends::{build_module, preset, PRESETS};
use nnscaler_passes::pipeline::{self, Step};
use nnscaler_passes::planner::cost::{self, Cluster};
use nnscaler_passes::planner::schedule::ScheduleKind;
use nnscaler_passes::planner::search::{self, bytes_text, Estimate, Outcome, Profile, Space};
use nnscaler_passes::transforms::recompute::has_backward;
use std::fmt::Write as _;
use std::time::Instant;

/// `nnscaler plan`'s command line.
#[derive(clap::Args, Debug)]
#[command(
    about = "Search the fastest plan (dp x tp x pp, micro-batches, schedule, recompute, ZeRO) for a model on a cluster",
    long_about = "Search the fastest plan for a model on a cluster: data, tensor and pipeline \
        parallel degrees (tensor parallelism by Megatron's rule, with or without sequence \
        parallelism, or each op's split searched by Z3), micro-batch size and count, pipeline schedule (1f1b, interleaved, \
        zb-h1, zb-v), recompute (none, selective, full) and ZeRO stage (0-3). The training \
        step is compiled for real at each tensor-parallel degree and micro-batch size, \
        each op predicted by the cost model, pipelines simulated with their schedule. \
        Prints the best plan (step time, MFU, memory per device), the next best ones and \
        why they lost, and the nnscaler-opt flags that apply it.\n\n\
        The model is a forward ending in a loss (nnscaler import) or a training step \
        (after --autodiff, --optimizer); a forward gets --autodiff --optimizer first. A \
        training step gets pipelines and micro-batches only when --place can stage it: \
        its backward ops must carry their forward ops' locations (print it with \
        nnscaler-opt --mlir-print-debuginfo); otherwise the output says why not. \
        Constraints on its ops (nns.split, nns.forbid) are kept: plans that break one are \
        out, named at the op. A mesh the module declares (constraints name its axes) \
        fixes the sizes of the dp, tp and pp axes it has; its memory_cap caps memory."
)]
pub struct PlanArgs {
    /// The model (MLIR); or use --preset.
    #[arg(value_name = "MODEL.mlir", required_unless_present = "preset")]
    pub module: Option<String>,
    /// A zoo preset instead of a file (see 'nnscaler presets').
    #[arg(long, value_name = "NAME", conflicts_with = "module")]
    pub preset: Option<String>,
    /// With --preset: sequences per step (the global batch).
    #[arg(long, value_name = "N", requires = "preset")]
    pub batch: Option<u64>,
    /// The cluster: a preset (dgx-a100, dgx-h100, h200, cpu) or a TOML file.
    #[arg(long, value_name = "PRESET|FILE")]
    pub cluster: String,
    /// Devices to plan for.
    #[arg(long, value_name = "N")]
    pub devices: u64,
    /// Bytes a device may use (e.g. 60GB, 64GiB; default: the device's memory).
    #[arg(long, value_name = "BYTES")]
    pub memory_cap: Option<String>,
    /// Largest tensor-parallel degree (default: the innermost network level's devices).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_tp: Option<u64>,
    /// Largest context-parallel degree (sp: the positions split over devices of their
    /// own; default: the innermost network level's devices, and no fewer than 1024
    /// positions per device; 1: none).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_sp: Option<u64>,
    /// Largest pipeline degree.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_pp: Option<u64>,
    /// Largest micro-batch size (sequences).
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_micro: u64,
    /// Fix parts of the plan and search the rest: parallel degrees (`dp=32,tp=8,pp=4`;
    /// axes dp, sp, tp, pp: one left out is 1 when sp, else searched), `recompute=none`,
    /// `selective` or `full`, `zero=0..3`, `splits=megatron`, `megatron-sp` or `searched`,
    /// and `schedule=NAME` (repeatable: the schedules to try). What a published run used,
    /// to predict it (bench/cost_validation.py).
    #[arg(long, value_name = "KEY=VALUE,...")]
    pub fix: Option<String>,
    /// Also search Megatron-LM's grid (uniform stages, 1F1B or interleaved, ZeRO 0 or 1)
    /// with the same model and print its best plan beside the search's.
    #[arg(long)]
    pub compare_megatron: bool,
    /// Arithmetic: f32; bf16 (mixed precision as PyTorch's autocast: the forward gets
    /// --autocast=bf16 first, matrix products in bf16, activations f32); or bf16-activations
    /// (as Megatron-LM's --bf16: --autocast="bf16 activations=bf16", every activation in bf16,
    /// the loss and the master weights f32). With bf16 the products are predicted at the bf16
    /// tensor-core rate and MFU is against the bf16 peak. A training step keeps the precision
    /// it was compiled with.
    #[arg(long, value_name = "f32|bf16|bf16-activations", default_value = "f32")]
    pub precision: String,
    /// Alternatives to print.
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub top: usize,
    /// Print JSON for tools instead of text.
    #[arg(long)]
    pub json: bool,
    /// Write the module with the best plan's directives (the passes up to --plan applied)
    /// to FILE; the rest of the pipeline then runs unchanged on it.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: Option<String>,
}

/// `text` with `passes` applied, as MLIR.
fn apply(text: &str, file: &str, passes: &[(String, String)]) -> Result<String, String> {
    let ir = IrContext::new();
    let mut m = ir
        .parse(text, file)
        .map_err(|d| d.render_limited(Some(text), 20))?;
    let steps: Vec<Step> = passes
        .iter()
        .map(|(n, o)| nnscaler_passes::registry::step(n, o))
        .collect::<Result<_, _>>()?;
    pipeline::run(&ir, &mut m, &steps, &mut |_, _| {}, file)
        .map_err(|d| d.render_limited(Some(text), 20))?;
    Ok(m.as_operation().to_string())
}

/// `60GB`, `64GiB`, `1e9`: bytes.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mul) = [
        ("TiB", 1u64 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("TB", 1_000_000_000_000),
        ("GB", 1_000_000_000),
        ("MB", 1_000_000),
        ("KB", 1_000),
        ("B", 1),
    ]
    .iter()
    .find_map(|(suffix, m)| t.strip_suffix(suffix).map(|n| (n, *m)))
    .unwrap_or((t, 1));
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a size in bytes (e.g. 60GB, 64GiB, 1e9)"))?;
    if !(v.is_finite() && v > 0.0) {
        return Err(format!("'{s}' must be a positive size"));
    }
    Ok((v * mul as f64) as u64)
}

/// What `--precision` asks for: the autocast a forward gets before `--autodiff`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// No casts.
    F32,
    /// `--autocast=bf16`: the matrix products in bf16.
    Bf16,
    /// `--autocast="bf16 activations=bf16"`: every activation in bf16.
    Bf16Activations,
}

impl Precision {
    /// `--precision`'s value.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            "bf16-activations" => Ok(Precision::Bf16Activations),
            other => Err(format!(
                "unknown precision '{other}' (f32, bf16 or bf16-activations)"
            )),
        }
    }

    /// The `--autocast` options it runs (`None`: none).
    pub fn autocast(self) -> Option<&'static str> {
        match self {
            Precision::F32 => None,
            Precision::Bf16 => Some("bf16"),
            Precision::Bf16Activations => Some("bf16 activations=bf16"),
        }
    }
}

/// The training step (single device) of the module: its largest function, after
/// `--autodiff --optimizer` when it is a forward (after `--autocast` first, as `precision`
/// asks).
pub fn training_step(
    text: &str,
    file: &str,
    precision: Precision,
) -> Result<(Graph, bool, Option<Mesh>), String> {
    let ir = IrContext::new();
    let mut m = ir
        .parse(text, file)
        .map_err(|d| d.render_limited(Some(text), 20))?;
    let mut d = Diagnostics::default();
    let meshes = Meshes::collect(&m.as_operation(), &mut d);
    if meshes.0.len() > 1 {
        return Err(format!("{file}: several meshes; plan takes one (or none)"));
    }
    let mesh = meshes.0.first().cloned();
    let largest = |m: &melior::ir::Module<'_>| -> Result<Graph, String> {
        Graph::all_in(m)
            .into_iter()
            .filter_map(Result::ok)
            .max_by_key(|g| g.nodes.len())
            .ok_or(format!("{file}: no function to plan"))
    };
    let g = largest(&m)?;
    if has_backward(&g) {
        if precision != Precision::F32 && !g.nodes.iter().any(|n| n.op == "dnn.cast") {
            return Err(format!(
                "{file}: --precision bf16 needs a forward (--autocast=bf16 runs before --autodiff); this training step is f32"
            ));
        }
        return Ok((g, false, mesh));
    }
    let mut steps = vec![
        nnscaler_passes::registry::step("autodiff", "")?,
        nnscaler_passes::registry::step("optimizer", "")?,
    ];
    if let Some(options) = precision.autocast() {
        steps.insert(0, nnscaler_passes::registry::step("autocast", options)?);
    }
    pipeline::run(&ir, &mut m, &steps, &mut |_, _| {}, file)
        .map_err(|d| d.render_limited(Some(text), 20))?;
    Ok((largest(&m)?, true, mesh))
}

/// The training step of forward `text` with its runs of identical layers cut
/// ([`nnscaler_passes::planner::layer_runs`]), for profiling; `None` when nothing is cut.
pub fn cut_step(
    text: &str,
    file: &str,
    precision: Precision,
) -> Result<Option<nnscaler_passes::planner::layer_runs::Cut>, String> {
    let ir = IrContext::new();
    let m = ir
        .parse(text, file)
        .map_err(|d| d.render_limited(Some(text), 20))?;
    let Some(forward) = Graph::all_in(&m)
        .into_iter()
        .filter_map(Result::ok)
        .max_by_key(|g| g.nodes.len())
    else {
        return Ok(None);
    };
    let Some(r) = nnscaler_passes::planner::layer_runs::reduce(&forward) else {
        return Ok(None);
    };
    let step = nnscaler_passes::planner::layer_runs::training_step_of(
        &r.forward,
        precision.autocast(),
        Some(""),
        nnscaler_passes::registry::lookup,
    )
    .map_err(|e| format!("{file}: the step with repeated layers cut: {e}"))?;
    Ok(Some(nnscaler_passes::planner::layer_runs::Cut {
        step,
        runs: r.runs,
    }))
}

/// Passes as (name, options).
pub type Passes = Vec<(String, String)>;

/// The passes (name, options) that apply plan `e`: those that write its directives into
/// the IR (up to `--plan`), then those that carry it out. `forward`: the input is a
/// forward (it gets `--autodiff --optimizer`; pipelines place it first).
/// `cluster` is the cluster as the user named it (a preset or a file), for `tp-search`;
/// `precision` the autocast a forward gets first.
pub fn apply_passes(
    e: &Estimate,
    p: &Profile,
    forward: bool,
    cluster: &str,
    precision: Precision,
) -> (Passes, Passes) {
    let c = &e.config;
    let mut before = Vec::new();
    let pass = |n: &str, o: String| (n.to_string(), o);
    let pipelined = c.pipelined();
    if pipelined {
        let stages = c.stage_starts.len();
        match p.place_layout(&c.stage_starts) {
            Some(l) if stages > 1 => {
                before.push(pass("place", format!("stages={stages} layout={l}")))
            }
            _ => before.push(pass("place", format!("stages={stages}"))),
        }
    }
    if forward {
        if let Some(options) = precision.autocast() {
            // Mixed precision: the search profiled the cast forward.
            before.insert(0, pass("autocast", options.into()));
        }
        before.push(pass("autodiff", String::new()));
    }
    if c.recompute != search::Recompute::None {
        before.push(pass("recompute", c.recompute.name().to_string()));
    }
    if forward {
        before.push(pass("optimizer", String::new()));
    }
    // The schedule goes into the plan (recorded on the step as `nns.schedule`), so the
    // written module carries it and `--schedule` runs it.
    let mut plan = c.plan_options(cluster);
    if pipelined {
        plan += &format!(" schedule={}", c.schedule_name());
    }
    before.push(pass("plan", plan));
    let mut after = vec![
        pass("propagate-layouts", String::new()),
        pass("split-tensor", String::new()),
    ];
    if pipelined {
        after.push(pass("schedule", String::new()));
    }
    // Each relayout's collectives chosen by their seconds on the cluster the plan was
    // predicted on, as the search's profiles chose them.
    after.push(pass("lower-relayouts", format!("cluster={cluster}")));
    after.push(pass("localize", String::new()));
    (before, after)
}

/// Passes as `nnscaler-opt` flags.
pub fn flags(passes: &[(String, String)]) -> String {
    passes
        .iter()
        .map(|(n, o)| match o.as_str() {
            "" => format!("--{n}"),
            o if o.contains(' ') => format!("--{n}=\"{o}\""),
            o => format!("--{n}={o}"),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The `nnscaler-opt` flags that apply plan `e` (see [`apply_passes`]).
pub fn apply_flags(
    e: &Estimate,
    p: &Profile,
    forward: bool,
    cluster: &str,
    precision: Precision,
) -> String {
    let (before, after) = apply_passes(e, p, forward, cluster, precision);
    flags(&[before, after].concat())
}

/// Why `e` lost to `best`: the part of the step it spends most more time on.
fn why_lost(e: &Estimate, best: &Estimate) -> String {
    let busy = |x: &Estimate| x.pipeline * (1.0 - x.bubble);
    let idle = |x: &Estimate| x.pipeline * x.bubble;
    let parts = [
        ("compute and tp/pp communication", busy(e) - busy(best)),
        ("pipeline bubbles", idle(e) - idle(best)),
        ("gradient sync over dp", e.dp_sync - best.dp_sync),
        ("optimizer update", e.optimizer - best.optimizer),
    ];
    let (what, d) = parts
        .iter()
        .copied()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or(("", 0.0));
    if d <= 0.0 {
        "ties".into()
    } else {
        format!("+{} in {what}", secs(d))
    }
}

/// Seconds with a unit that reads.
fn secs(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.3} us", s * 1e6)
    }
}

/// Shares of the step: compute (the ops, the optimizer), communication (every
/// collective and pipeline send the busiest rank waits for: the runtime overlaps none of
/// them with compute, and neither does the model) and the pipeline's bubbles.
fn shares(e: &Estimate) -> (f64, f64, f64) {
    if e.seconds <= 0.0 {
        return (0.0, 0.0, 0.0);
    }
    let comm = (e.tp_comm + e.pp_comm + e.dp_comm).min(e.seconds);
    let bubble = (e.bubble * e.pipeline).min(e.seconds - comm);
    let compute = (e.seconds - comm - bubble).max(0.0);
    (compute / e.seconds, comm / e.seconds, bubble / e.seconds)
}

fn line(e: &Estimate) -> String {
    // The collectives inside the layers: tensor parallelism's, and context parallelism's
    // (the keys' and values' gathers) when the positions are split.
    let inner = if e.config.sp > 1 { "tp/sp" } else { "tp" };
    format!(
        "{}: {} per step (pipeline {}, bubble {:.1}%, {} sync {}, optimizer {}; communication: {inner} {}, pp {}, dp {}), MFU {:.1}% (step: compute {:.1}%, communication {:.1}%, bubble {:.1}%), {} per device",
        e.config.describe(),
        secs(e.seconds),
        secs(e.pipeline),
        e.bubble * 100.0,
        if e.config.sp > 1 { "dp x sp" } else { "dp" },
        secs(e.dp_sync),
        secs(e.optimizer),
        secs(e.tp_comm),
        secs(e.pp_comm),
        secs(e.dp_comm),
        e.mfu * 100.0,
        shares(e).0 * 100.0,
        shares(e).1 * 100.0,
        shares(e).2 * 100.0,
        bytes_text(e.memory)
    )
}

/// Runs the search; returns what to print.
pub fn main(a: &PlanArgs) -> Result<String, String> {
    let cluster: Cluster = cost::load(&a.cluster)?;
    let (text, name) = match (&a.module, &a.preset) {
        (_, Some(p)) => {
            let mut c = preset(p).ok_or_else(|| {
                let names: Vec<&str> = PRESETS.iter().map(|p| p.0).collect();
                format!("unknown preset '{p}' (presets: {})", names.join(", "))
            })?;
            if let Some(b) = a.batch {
                c.set("batch", &b.to_string())?;
            }
            (build_module(&c).map_err(|e| e.to_string())?, p.clone())
        }
        (Some(f), None) => (crate::read_input(f)?, f.clone()),
        (None, None) => return Err("plan needs a model file or --preset".into()),
    };
    if a.devices == 0 {
        return Err("--devices must be at least 1".into());
    }
    let start = Instant::now();
    let precision = Precision::parse(&a.precision).map_err(|e| format!("--precision: {e}"))?;
    let (step, differentiated, mesh) = training_step(&text, &name, precision)?;
    let batch = search::batch_of(&step).ok_or(format!(
        "{name}: the step has no batched data argument to split"
    ))?;
    let (mut space, mesh_cap) = search_space(a, mesh.as_ref(), &name)?;
    // A training step can be placed in pipeline stages when its backward ops kept their
    // forward ops' locations (a step printed with --mlir-print-debuginfo).
    let unplaceable = if differentiated {
        None
    } else {
        nnscaler_passes::transforms::place::placeable(&step).err()
    };
    space.pipelines = unplaceable.is_none();
    let quiet = a.json;
    let mut progress = |msg: &str| {
        if !quiet {
            eprintln!(
                "nnscaler plan: {msg} ({:.1} s)",
                start.elapsed().as_secs_f64()
            );
        }
    };
    // Profiles compile the forward with its runs of identical layers cut to their first,
    // second and last (layer_runs.rs): a 96-layer model profiles as a 3-layer one.
    let cut = match (differentiated, &mesh) {
        (true, None) => cut_step(&text, &name, precision)?,
        (false, None) => {
            nnscaler_passes::planner::layer_runs::cut_step(&step, nnscaler_passes::registry::lookup)
        }
        _ => None,
    };
    if let Some(c) = &cut {
        let layers: usize = c.runs.iter().map(|r| r.names.len() - 1).sum();
        progress(&format!(
            "profiling with {layers} repeated layers cut (they cost what the one kept costs)"
        ));
    }
    let mut profiles = search::Profiles::new();
    let found = search::search_with(
        &step,
        cut.as_ref(),
        &cluster,
        &space,
        &mut profiles,
        &mut progress,
    )?;
    let searched = start.elapsed().as_secs_f64();
    let grid = if a.compare_megatron {
        let mut g = Space::megatron(a.devices);
        g.memory_cap = space.memory_cap;
        g.fixed = space.fixed.clone();
        g.pipelines = space.pipelines;
        g.max_tp = a.max_tp;
        g.max_pp = a.max_pp;
        g.max_micro = space.max_micro;
        Some(search::search_with(
            &step,
            cut.as_ref(),
            &cluster,
            &g,
            &mut profiles,
            &mut progress,
        )?)
    } else {
        None
    };
    let total = start.elapsed().as_secs_f64();
    let Some(best) = found.ranked.first() else {
        return Err(no_plan(a, &found, &cluster, &space, mesh_cap));
    };
    // The profile of the best plan, for its stages' names and flags.
    let prof = match profiles.get(&search::profile_key(&best.config)) {
        Some(Ok(p)) => p.clone(),
        _ => search::profile_sp(
            &step,
            best.config.tp,
            best.config.sp,
            best.config.micro,
            &cluster,
            best.config.tensor,
        )?,
    };
    let mut wrote = String::new();
    if let Some(out) = &a.output {
        let (before, after) = apply_passes(best, &prof, differentiated, &a.cluster, precision);
        let planned = apply(&text, &name, &before)?;
        crate::write_one(out, planned.into_bytes())?;
        if out != "-" {
            wrote = format!(
                "wrote {out} (the plan as directives); carry it out with: nnscaler-opt {} {out}\n",
                flags(&after)
            );
        }
    }
    let report = Report {
        a,
        name: &name,
        cluster: &cluster,
        batch,
        differentiated,
        precision,
        found: &found,
        grid: grid.as_ref(),
        profiles: &profiles,
        best,
        prof: &prof,
        unplaceable: unplaceable.as_deref(),
        memory_cap: space.memory_cap,
        searched,
        total,
    };
    if a.json {
        return report.json();
    }
    Ok(report.text(&wrote))
}

/// The search space `a` asks for: the devices, caps, limits and `--fix`, with a mesh the
/// module declares (for its ops' constraints) fixing its axes' sizes and micro-batches;
/// also the mesh's own memory cap, if any (named where no plan fits under it).
fn search_space(
    a: &PlanArgs,
    mesh: Option<&Mesh>,
    name: &str,
) -> Result<(Space, Option<u64>), String> {
    let mut space = Space::new(a.devices);
    space.memory_cap = a.memory_cap.as_deref().map(parse_bytes).transpose()?;
    space.max_tp = a.max_tp;
    space.max_sp = a.max_sp;
    space.max_pp = a.max_pp;
    space.max_micro = a.max_micro.max(1);
    space.keep = space.keep.max(a.top + 1);
    let mut mesh_cap = None;
    // A mesh the module declares (for its ops' constraints) fixes its dp / tp / pp axes'
    // sizes, and its memory_cap caps memory.
    if let Some(m) = mesh {
        for axis in m.axes.iter().filter(|x| !x.microbatches) {
            if !["dp", "sp", "tp", "pp"].contains(&axis.name.as_str()) {
                return Err(format!(
                    "{name}: mesh '@{}' has axis '{}'; plan knows dp, sp, tp and pp",
                    m.name, axis.name
                ));
            }
            space
                .fixed
                .push((axis.name.clone(), axis.size.max(1) as u64));
        }
        space.microbatches = Some(m.microbatch_axis().map_or(1, |a| a.size.max(1) as u64));
        if let Some(cap) = m.memory_cap {
            let cap = cap.max(0) as u64;
            space.memory_cap = Some(space.memory_cap.map_or(cap, |c| c.min(cap)));
            mesh_cap = Some(cap);
        }
    }
    if let Some(fix) = &a.fix {
        if mesh.is_some() {
            return Err(format!(
                "--fix: {name} declares a mesh, which fixes the degrees already"
            ));
        }
        apply_fix(fix, a.devices, &mut space)?;
    }
    Ok((space, mesh_cap))
}

/// Why no plan fits: the plans out and why, and the leanest plan's memory against the
/// cap and where the cap comes from.
fn no_plan(
    a: &PlanArgs,
    found: &Outcome,
    cluster: &Cluster,
    space: &Space,
    mesh_cap: Option<u64>,
) -> String {
    let why: Vec<String> = found
        .out
        .iter()
        .map(|(r, k)| format!("{k} x {r}"))
        .collect();
    let cap = cluster.device.memory_limit(space.memory_cap);
    let least = found
        .least_memory
        .map(|m| {
            format!(
                "; the leanest plan needs at least {} per device, the cap is {} ({})",
                bytes_text(m),
                bytes_text(cap),
                if space
                    .memory_cap
                    .is_none_or(|c| c >= cluster.device.usable_memory())
                {
                    "the device's memory less the runtime's reserve and the allocator's margin"
                } else if mesh_cap == space.memory_cap {
                    "the mesh's memory_cap"
                } else {
                    "--memory-cap"
                }
            )
        })
        .unwrap_or_default();
    format!(
        "no plan for {} devices of {} fits: {}{least}",
        a.devices,
        cluster.name,
        why.join("; ")
    )
}

/// What `nnscaler plan` found, for its report ([`Report::json`], [`Report::text`]).
#[derive(Clone, Copy)]
struct Report<'a> {
    a: &'a PlanArgs,
    name: &'a str,
    cluster: &'a Cluster,
    batch: u64,
    /// A forward given `--autodiff --optimizer` here.
    differentiated: bool,
    /// The autocast it got first.
    precision: Precision,
    found: &'a Outcome,
    /// The Megatron grid's outcome, with `--compare-megatron`.
    grid: Option<&'a Outcome>,
    profiles: &'a search::Profiles,
    best: &'a Estimate,
    /// The best plan's profile.
    prof: &'a Profile,
    /// Why pipelines were not searched, if they were not.
    unplaceable: Option<&'a str>,
    memory_cap: Option<u64>,
    /// Seconds the search took, and with the grid.
    searched: f64,
    total: f64,
}

impl Report<'_> {
    /// The report as JSON (`--json`).
    fn json(&self) -> Result<String, String> {
        let Report {
            a,
            name,
            cluster,
            batch,
            differentiated,
            precision,
            found,
            grid,
            profiles,
            best,
            prof,
            unplaceable,
            memory_cap,
            searched,
            ..
        } = *self;
        let j = serde_json::json!({
            "model": name,
            "cluster": cluster.name,
            "devices": a.devices,
            "batch": batch,
            "best": best,
            "flags": apply_flags(best, prof, differentiated, &a.cluster, precision),
            "alternatives": found
                .ranked
                .iter()
                .skip(1)
                .take(a.top)
                .map(|e| {
                    let mut v = serde_json::to_value(e).unwrap_or_default();
                    if let Some(Ok(p)) = profiles.get(&search::profile_key(&e.config)) {
                        v["flags"] = apply_flags(e, p, differentiated, &a.cluster, precision).into();
                        v["why_lost"] = why_lost(e, best).into();
                    }
                    v
                })
                .collect::<Vec<_>>(),
            "considered": found.considered,
            "simulated": found.simulated,
            "out": found.out,
            "pipelines_not_searched": unplaceable,
            "search_seconds": searched,
            "megatron": grid.map(|g: &Outcome| g.ranked.first()),
            "mfu_peak_flops": cluster.device.matrix_rate(prof.bf16),
            "step_shares": {
                "compute": shares(best).0,
                "communication": shares(best).1,
                "bubble": shares(best).2,
                "overlap": false,
            },
            "memory": {
                "device": cluster.device.memory,
                "reserved": cluster.device.reserved,
                "fragmentation": cluster.device.fragmentation,
                "limit": cluster.device.memory_limit(memory_cap),
            },
        });
        serde_json::to_string_pretty(&j)
            .map(|s| s + "\n")
            .map_err(|e| e.to_string())
    }

    /// The report as text; `wrote` says where the plan went (`-o`).
    fn text(&self, wrote: &str) -> String {
        let Report {
            a,
            name,
            cluster,
            batch,
            differentiated,
            precision,
            found,
            grid,
            best,
            prof,
            unplaceable,
            memory_cap,
            searched,
            total,
            ..
        } = *self;
        let mut o = String::new();
        let _ = writeln!(
            o,
            "plan: {name} ({}batch {batch}) on {} x {} ({})",
            if differentiated {
                "a forward given --autodiff --optimizer, "
            } else {
                ""
            },
            a.devices,
            cluster.device.name,
            cluster.name
        );
        let _ = writeln!(
            o,
            "searched {} plans ({} simulated; the rest out of memory by a lower bound, or bounded out) in {searched:.2} s",
            found.considered, found.simulated
        );
        let peak = cluster.device.matrix_rate(prof.bf16);
        let _ = writeln!(
            o,
            "MFU: the model's FLOPs per second against the device's {} matrix peak ({:.1} TFLOP/s){}",
            if prof.bf16 && cluster.device.matrix_flops_bf16.is_some() {
                "bf16"
            } else {
                "f32"
            },
            peak / 1e12,
            if prof.bf16 {
                ""
            } else {
                "; --precision bf16 plans mixed precision, against the bf16 peak"
            }
        );
        let d = &cluster.device;
        let limit = d.memory_limit(memory_cap);
        let _ = writeln!(
            o,
            "memory: {} per device{}; a plan may use {}{}",
            bytes_text(d.memory),
            if d.reserved > 0 || d.fragmentation > 0.0 {
                format!(
                    ", less {} the runtime holds (CUDA context, cuBLAS workspace, NCCL buffers) and an allocator margin of {:.0}%",
                    bytes_text(d.reserved),
                    d.fragmentation * 100.0
                )
            } else {
                String::new()
            },
            bytes_text(limit),
            if limit < d.usable_memory() {
                " (the memory cap)"
            } else {
                ""
            }
        );
        let _ = writeln!(
            o,
            "step: no communication overlaps compute (the runtime overlaps none, so the model overlaps none)"
        );
        let _ = writeln!(o, "best: {}", line(best));
        let names: Vec<String> = best
            .config
            .stage_starts
            .iter()
            .enumerate()
            .map(|(s, &lo)| {
                let hi = best
                    .config
                    .stage_starts
                    .get(s + 1)
                    .copied()
                    .unwrap_or(prof.items.len());
                let first = &prof.items[lo].name;
                let last = &prof.items[hi - 1].name;
                if lo + 1 == hi {
                    first.clone()
                } else {
                    format!("{first}..{last}")
                }
            })
            .collect();
        if names.len() > 1 {
            let _ = writeln!(o, "stages: {}", names.join(" | "));
        }
        let _ = writeln!(
            o,
            "apply: nnscaler-opt {}",
            apply_flags(best, prof, differentiated, &a.cluster, precision)
        );
        o += wrote;
        if found.ranked.len() > 1 {
            let _ = writeln!(o, "next best:");
            for e in found.ranked.iter().skip(1).take(a.top) {
                let _ = writeln!(
                    o,
                    "  {} ({:+.1}%: {})",
                    line(e),
                    (e.seconds / best.seconds - 1.0) * 100.0,
                    why_lost(e, best)
                );
            }
        }
        for (r, k) in &found.out {
            let _ = writeln!(o, "out: {k} plan{} ({r})", if *k == 1 { "" } else { "s" });
        }
        if let Some(why) = &unplaceable {
            let _ = writeln!(
                o,
                "pipelines and micro-batches not searched: the step cannot be placed in stages ({why})"
            );
        }
        if let Some(g) = &grid {
            match g.ranked.first() {
                Some(m) => {
                    let _ = writeln!(o, "megatron grid best: {}", line(m));
                    let _ = writeln!(
                        o,
                        "search / megatron grid: {:.3} ({} grid plans, {:.2} s in all)",
                        best.seconds / m.seconds,
                        g.considered,
                        total
                    );
                }
                None => {
                    let _ = writeln!(o, "megatron grid: no plan fits");
                }
            }
        }
        o
    }
}

/// `--fix`'s `AXIS=N` degrees and `recompute=`, `zero=`, `splits=`, `schedule=` choices
/// applied to `space` (for `devices` devices).
fn apply_fix(fix: &str, devices: u64, space: &mut Space) -> Result<(), String> {
    let mut schedules: Vec<ScheduleKind> = Vec::new();
    for part in fix.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (axis, n) = part
            .split_once('=')
            .ok_or_else(|| format!("--fix: '{part}' is not AXIS=N (e.g. dp=32,tp=8)"))?;
        let (axis, value) = (axis.trim(), n.trim());
        match axis {
            "recompute" => {
                let r = [
                    search::Recompute::None,
                    search::Recompute::Selective,
                    search::Recompute::Full,
                ]
                .into_iter()
                .find(|r| r.name() == value)
                .ok_or_else(|| format!("--fix: recompute={value}: none, selective or full"))?;
                space.recompute = vec![r];
                continue;
            }
            "zero" => {
                let z: u8 = value
                    .parse()
                    .ok()
                    .filter(|&z| z <= 3)
                    .ok_or_else(|| format!("--fix: zero={value}: a stage 0 to 3"))?;
                space.zero = vec![z];
                continue;
            }
            "splits" => {
                let t = match value {
                    "megatron" => search::TpPolicy::Megatron,
                    "megatron-sp" => search::TpPolicy::Sp,
                    "searched" => search::TpPolicy::Search,
                    _ => {
                        return Err(format!(
                            "--fix: splits={value}: megatron, megatron-sp or searched"
                        ))
                    }
                };
                space.tensor = vec![t];
                continue;
            }
            "schedule" => {
                let Some(k) =
                    ScheduleKind::from_name(value).filter(|k| Space::new(1).schedules.contains(k))
                else {
                    return Err(format!(
                        "--fix: schedule={value}: 1f1b, interleaved, zb-h1 or zb-v"
                    ));
                };
                schedules.push(k);
                continue;
            }
            "dp" | "sp" | "tp" | "pp" => {}
            _ => {
                return Err(format!(
                "--fix: unknown key '{axis}' (dp, sp, tp, pp, recompute, zero, splits, schedule)"
            ))
            }
        }
        let n: u64 = n
            .trim()
            .parse()
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| format!("--fix: '{part}': the degree must be an integer >= 1"))?;
        if space.fixed.iter().any(|(x, _)| x == axis) {
            return Err(format!("--fix: axis '{axis}' is given twice"));
        }
        space.fixed.push((axis.to_string(), n));
    }
    if !schedules.is_empty() {
        space.schedules = schedules;
    }
    let product: u64 = space.fixed.iter().map(|(_, n)| n).product();
    if space.fixed.len() == 4 && product != devices || product > devices {
        return Err(format!(
            "--fix {fix}: the degrees multiply to {product}, not to the {} devices",
            devices
        ));
    }
    Ok(())
}

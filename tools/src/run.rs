//! `nnscaler run`: executes a function of a model on the CPU runtime, with tensors from and
//! to safetensors files.

use crate::Outputs;
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::diag::{Diagnostics, SrcLoc};
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::types::Elem;
use nnscaler_dialects::verify::Meshes;
use nnscaler_passes::transforms::autodiff::{differentiate_with, vjp_function, vjp_name};
use nnscaler_runtime::interp::{bind, ParamSource};
use nnscaler_runtime::spmd::{global_view, pipeline_programs, run_pipeline, run_spmd};
use nnscaler_runtime::{io, kernels, memory, Options};
use std::path::Path;

/// `nnscaler run`'s command line.
#[derive(clap::Args, Debug, Default)]
#[command(
    about = "Execute a function on the CPU reference runtime",
    long_about = "Execute a function on the CPU reference runtime.\n\n\
        Arguments are read by their nns.name: inputs from --inputs, nns.param arguments from \
        --params or drawn with --init-seed (normal(0, 0.02); norm weights 1, biases 0; nns.init \
        overrides). Results are written under their nns.name (or out0, out1, ...). Outputs are \
        written only when the whole run succeeded; then one line says where it ran, how long \
        it took, the scalar results (such as the loss) and where the results went (on stderr \
        when they go to standard output). nnscaler data random MODEL writes inputs for it.\n\n\
        A function made by --localize runs on every device of its mesh (a thread each, \
        in-process collectives): inputs are cut and results assembled by their nns.layout, so \
        the tensor files are the same as on one device."
)]
pub struct RunArgs {
    /// The model (MLIR file).
    #[arg(value_name = "MODEL.mlir")]
    pub model: String,
    /// Where the results go (safetensors).
    #[arg(short = 'o', long = "output", value_name = "OUT.safetensors")]
    pub output: String,
    /// Input tensors (safetensors), matched to arguments by nns.name.
    #[arg(long, value_name = "IN.safetensors")]
    pub inputs: Option<String>,
    /// Parameters (safetensors), matched to nns.param arguments by nns.name.
    #[arg(long, value_name = "P.safetensors", conflicts_with = "init_seed")]
    pub params: Option<String>,
    /// Draw the parameters from seed S instead.
    #[arg(long, value_name = "S")]
    pub init_seed: Option<u64>,
    /// The function to run (default: the only one, or @train).
    #[arg(long, value_name = "NAME")]
    pub func: Option<String>,
    /// Differentiate first (as nnscaler-opt --autodiff): the results then include
    /// grad.<param> for every parameter.
    #[arg(long)]
    pub autodiff: bool,
    /// Also write the parameters used (e.g. drawn with --init-seed).
    #[arg(long, value_name = "FILE")]
    pub save_params: Option<String>,
    /// Stop at the first op producing NaN or Inf, naming it.
    #[arg(long)]
    pub check_finite: bool,
    /// Threads for matrix products.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: u16,
    /// Expect N simulated devices (the mesh of a localized function).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(i64).range(1..))]
    pub devices: Option<i64>,
    /// Refuse to start when the run is estimated to need more memory than this (e.g. 8G;
    /// default: the memory this process may still use: available memory, cgroup and
    /// address-space limits).
    #[arg(long, value_name = "BYTES", value_parser = crate::cli::parse_bytes)]
    pub memory_limit: Option<u64>,
    /// Where the ops run: reference (the CPU runtime's kernels), host (compiled to GPU-style
    /// kernels, run on the CPU through nnscaler-rt's launch plan), or cuda (the same on GPU
    /// 0; nnscaler built with --features cuda).
    #[arg(long, default_value = "reference", value_parser = ["reference", "host", "cuda"])]
    pub backend: String,
    /// With --backend host or cuda: run every device on a thread of its own, as the ranks
    /// of a cluster do, instead of all devices in lockstep: collectives through a
    /// communicator, messages matched in order as NCCL matches them (a deadlock is
    /// reported). host: an in-process communicator, the same results bit for bit; cuda:
    /// NCCL, device d on GPU d, or a stream per device on GPU 0 when the GPUs are fewer
    /// than the devices or NCCL does not load.
    #[arg(long)]
    pub ranks: bool,
    /// Run it this many times and print the median and fastest time of a run (to stderr;
    /// the results are the last run's); on simulated devices also the median and fastest
    /// of the devices' own time, without cutting inputs into pieces and assembling results;
    /// with --backend host or cuda, of the launch plan's steps (compiled once).
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub repeat: u32,
    /// Time every op and print, per op name, its calls, measured and predicted
    /// milliseconds per run and their ratio (to stderr), predicted by the cost model for
    /// CLUSTER (a preset or a TOML file such as `nnscaler calibrate`'s; default: cpu). On
    /// simulated devices: the mean of the devices; for a pipeline, one table per rank (the
    /// mean of the rank's devices, against its program's prediction). With --repeat N, the
    /// runs after the first (which warms up). With --timing serial, by the serial clock
    /// (each op's CPU time; a collective or receive also its wait for the partners on
    /// that clock). --backend reference.
    #[arg(long, value_name = "CLUSTER", num_args = 0..=1, default_missing_value = "cpu",
          require_equals = true)]
    pub profile: Option<String>,
    /// How simulated devices are timed (--repeat's "simulated devices" figures): wall (they
    /// run at once, a thread each, timed by the wall clock: what this machine does) or
    /// serial (they take turns on one core, each timed by its thread's CPU time on a
    /// virtual clock that collectives and messages synchronise: the step of devices with a
    /// core each and nothing else running, steady on a busy or small machine; needs
    /// --threads 1; a single-device function is then timed by its thread's CPU time as
    /// well). The results are the same bits either way, and so is the runs' wall-clock
    /// time printed first.
    #[arg(long, value_name = "MODE", default_value = "wall", value_parser = ["wall", "serial"])]
    pub timing: String,
}

/// Runs `nnscaler run`. Errors are complete messages (at most `error_limit` errors).
pub fn main(a: &RunArgs, error_limit: usize) -> Result<(), String> {
    check_flags(a)?;
    kernels::set_threads(usize::from(a.threads));
    let model = a.model.clone();
    let ir = IrContext::new();
    let (source, module) = crate::load_module(&ir, &model, error_limit)?;
    let render =
        |d: Diagnostics| -> String { d.in_file(&model).render_limited(Some(&source), error_limit) };
    let mut funcs: Vec<Result<Graph, (SrcLoc, String)>> = Graph::all_in(&module)
        .into_iter()
        .map(|f| f.map_err(|e| (e.loc, e.message)))
        .collect();
    let name_of = |f: &Result<Graph, (SrcLoc, String)>| match f {
        Ok(g) => g.name.clone(),
        Err(_) => String::new(),
    };
    let names: Vec<String> = funcs.iter().map(name_of).collect();
    if funcs.is_empty() {
        return Err(format!("{model}: the module has no function to run"));
    }
    // A pipelined step (the programs of a --schedule-* pass) runs as one function.
    let pipeline = crate::compile::pipeline_named(
        funcs.iter().filter_map(|f| f.as_ref().ok()),
        a.func.as_deref(),
    );
    if let Some(p) = pipeline {
        let all: Vec<Graph> = funcs.into_iter().filter_map(Result::ok).collect();
        return run_pipelined(a, &module, all, &p, &render);
    }
    let pick = pick_function(&names, a.func.as_deref(), model.as_str())?;
    let mut g = funcs.swap_remove(pick).map_err(|(loc, m)| {
        let mut d = Diagnostics::default();
        d.error(&loc, m);
        render(d)
    })?;
    // The module's other functions: what @g may call (declarations are not graphs).
    let mut all: Vec<Graph> = funcs.into_iter().filter_map(Result::ok).collect();
    if a.autodiff {
        let located = |(loc, m): (SrcLoc, String)| {
            let mut d = Diagnostics::default();
            d.error(&loc, m);
            render(d)
        };
        let mut derive = Vec::new();
        g = differentiate_with(&g, &mut derive).map_err(located)?;
        // Derived VJP functions of user ops without `nns.vjp`, made in memory (as the
        // autodiff pass makes them in the module).
        let mut done = 0;
        while done < derive.len() {
            let name = derive[done].clone();
            done += 1;
            if all.iter().any(|f| f.name == vjp_name(&name)) {
                continue;
            }
            let f = all
                .iter()
                .find(|f| f.name == name)
                .cloned()
                .ok_or_else(|| format!("{model}: no function @{name}"))?;
            let u = g
                .user_ops
                .0
                .get(&name)
                .cloned()
                .ok_or_else(|| format!("{model}: @{name} is not a user op"))?;
            let v = vjp_function(f, &u, &mut derive).map_err(located)?;
            all.push(v);
        }
    }
    g.link(&all);
    // A localized function takes whole tensors: bind against its global view.
    let mut d = Diagnostics::default();
    let meshes = Meshes::collect(&module.as_operation(), &mut d);
    let mesh = mesh_of(a, &g, &meshes, &model)?;
    let view = match mesh {
        Some(mesh) => global_view(&g, mesh).map_err(|e| format!("{model}: @{}: {e}", g.name))?,
        None => g.clone(),
    };
    // Before anything is read or drawn: refuse a run that cannot fit in memory.
    let devices = mesh.map_or(1, |m| m.devices() as u64);
    let mut need = memory::estimate(&g, &view, devices);
    if a.save_params.is_some() {
        need.results = need.results.saturating_add(need.params);
    }
    let threads = if devices > 1 { devices } else { 0 } + u64::from(a.threads) - 1;
    memory::check(&need, a.memory_limit, threads)
        .map_err(|e| format!("{model}: @{}: {e}", g.name))?;
    let (mut values, saved_params) = bind_all(a, &view)?;
    let opts = Options {
        check_finite: a.check_finite,
        profile_devices: a.profile.is_some(),
        serial_devices: a.timing == "serial",
    };
    let cluster = profile_cluster(a)?;
    if a.backend != "reference" {
        if a.check_finite {
            return Err("--check-finite needs --backend reference (compiled kernels are not checked op by op)".into());
        }
        let (outs, mut times) = crate::compile::run_compiled(
            &g,
            mesh,
            &a.model,
            &a.backend,
            a.ranks,
            values,
            a.repeat as usize,
        )
        .map_err(|e| format!("{model}: @{}: {e}", g.name))?;
        report_compiled(&g.name, a, &mut times);
        let ran = Ran::new(&g.name, compiled_place(a, devices), &times);
        return write_results(a, &g, &outs, saved_params, &ran);
    }
    let mut times = Vec::new();
    let mut device_times = Vec::new();
    let mut outs = Vec::new();
    let mut profile = nnscaler_runtime::Profile::default();
    for run in 0..a.repeat {
        // The inputs are copied for every run but the last (outside the clock), which
        // takes them: one run holds them once.
        let inputs = if run + 1 == a.repeat {
            std::mem::take(&mut values)
        } else {
            values.clone()
        };
        // With --repeat, the first run warms up (first-touch memory, the GEMM's buffers)
        // and is left out of the profile.
        let timed = cluster.is_some() && (run > 0 || a.repeat == 1);
        let started = std::time::Instant::now();
        let cpu = nnscaler_runtime::spmd::thread_cpu_seconds();
        outs = match mesh {
            Some(mesh) => run_spmd(&g, mesh, inputs, &opts),
            None => {
                nnscaler_runtime::run_profiled(&g, inputs, &opts, timed.then_some(&mut profile))
            }
        }
        .map_err(|e| {
            let mut d = Diagnostics::default();
            d.error(&e.loc, e.message);
            render(d)
        })?;
        times.push(started.elapsed().as_secs_f64());
        if mesh.is_none() && a.timing == "serial" {
            // One device runs on this thread: its CPU time.
            device_times.push(nnscaler_runtime::spmd::thread_cpu_seconds() - cpu);
        }
        if mesh.is_some() {
            device_times.push(nnscaler_runtime::spmd::device_seconds());
            // Every device's op times, added up: the table shows their mean.
            if timed {
                for p in nnscaler_runtime::spmd::device_profiles() {
                    profile.merge(&p);
                }
            }
        }
    }
    report_times(
        &g.name,
        &mut times,
        &mut device_times,
        (&a.timing, mesh.is_some()),
    );
    let place = match mesh {
        Some(m) => format!("the reference runtime, {} simulated devices", m.devices()),
        None => "the reference runtime".to_string(),
    };
    let ran = Ran::new(&g.name, place, &times);
    if let Some(c) = &cluster {
        let devices = mesh.map_or(1, |m| m.devices() as u32);
        let runs = if a.repeat > 1 { a.repeat - 1 } else { 1 };
        eprint!("{}", profile_table(&g, mesh, c, &profile, (runs, devices)));
    }
    write_results(a, &g, &outs, saved_params, &ran)
}

/// Flags that do not go together.
fn check_flags(a: &RunArgs) -> Result<(), String> {
    if a.ranks && a.backend == "reference" {
        return Err("--ranks needs --backend host or cuda (the reference backend's simulated devices already run a thread each)".into());
    }
    if a.timing == "serial" && a.threads > 1 {
        return Err(format!("--timing serial times each device by its own thread's CPU time, which matrix products on {} threads would leave out; use --threads 1", a.threads));
    }
    if a.timing == "serial" && a.backend != "reference" {
        return Err("--timing serial times the reference backend's simulated devices; --backend host and cuda time the launch plan's steps".into());
    }
    Ok(())
}

/// The mesh a localized `g` runs on (checked against `--devices` and `--autodiff`), or
/// none for a single-device function.
fn mesh_of<'m>(
    a: &RunArgs,
    g: &Graph,
    meshes: &'m Meshes,
    model: &str,
) -> Result<Option<&'m nnscaler_dialects::nns::Mesh>, String> {
    Ok(if g.is_localized() {
        if a.autodiff {
            return Err(format!(
                "--autodiff: @{} is localized; differentiate before partitioning",
                g.name
            ));
        }
        let mesh = meshes.resolve(None).map_err(|e| format!("{model}: {e}"))?;
        if let Some(mb) = mesh.microbatch_axis() {
            return Err(format!(
                "{model}: @{} is cut into {} micro-batches (mesh axis '{}'), which only a pipeline schedule runs; add a --schedule-* pass (e.g. --schedule-1f1b) before --lower-relayouts",
                g.name, mb.size, mb.name
            ));
        }
        if let Some(n) = a.devices.filter(|&n| n != mesh.devices()) {
            return Err(format!(
                "--devices {n}, but @{} runs on mesh '@{}' of {} devices",
                g.name,
                mesh.name,
                mesh.devices()
            ));
        }
        Some(mesh)
    } else {
        if let Some(n) = a.devices.filter(|&n| n > 1) {
            return Err(format!(
                "--devices {n}: @{} is a single-device function; partition it first (nnscaler-opt --plan=... --propagate-layouts --split-tensor --lower-relayouts --localize)",
                g.name
            ));
        }
        None
    })
}

/// `--profile`'s table: per op name (a call of a C kernel as `@callee`; the ops of an IR
/// function a call runs under their own names), calls, measured and predicted
/// milliseconds per run of one device (the mean over the simulated devices) and predicted
/// / measured, slowest measured first, then the total.
fn profile_table(
    g: &Graph,
    mesh: Option<&nnscaler_dialects::nns::Mesh>,
    cluster: &nnscaler_passes::planner::cost::Cluster,
    measured: &nnscaler_runtime::Profile,
    (runs, devices): (u32, u32),
) -> String {
    let mut predicted: std::collections::HashMap<String, f64> = Default::default();
    predict_ops(
        g,
        mesh,
        &cluster.for_program(g),
        &mut predicted,
        (0, &mut Default::default()),
    );
    let per = f64::from(runs.max(1)) * f64::from(devices.max(1));
    let mut rows: Vec<(String, f64, f64, Option<f64>)> = measured
        .ops
        .iter()
        .map(|(op, calls, secs)| {
            (
                op.clone(),
                *calls as f64 / per,
                secs / per,
                predicted.get(op).copied(),
            )
        })
        .collect();
    rows.sort_by(|x, y| y.2.total_cmp(&x.2));
    let mut out = format!(
        "profile of @{} per run ({} run{}{}), predicted for {}:\n{:<26} {:>7} {:>12} {:>12} {:>7}\n",
        g.name,
        runs,
        if runs == 1 { "" } else { "s after the first" },
        if devices > 1 {
            format!(", the mean of {devices} simulated devices")
        } else {
            String::new()
        },
        cluster.name,
        "op",
        "calls",
        "measured ms",
        "predicted ms",
        "ratio"
    );
    let (mut tm, mut tp) = (0.0, 0.0);
    for (op, calls, m, p) in &rows {
        tm += m;
        tp += p.unwrap_or(0.0);
        let (pt, ratio) = match p {
            Some(p) => (
                format!("{:.3}", p * 1e3),
                if *m > 0.0 {
                    format!("{:.2}", p / m)
                } else {
                    "-".into()
                },
            ),
            None => ("-".into(), "-".into()),
        };
        let calls = if calls.fract() == 0.0 {
            format!("{calls}")
        } else {
            format!("{calls:.1}")
        };
        out += &format!(
            "{op:<26} {calls:>7} {:>12.3} {pt:>12} {ratio:>7}\n",
            m * 1e3
        );
    }
    out += &format!(
        "{:<26} {:>7} {:>12.3} {:>12.3} {:>7.2}\n",
        "total",
        "",
        tm * 1e3,
        tp * 1e3,
        if tm > 0.0 { tp / tm } else { 0.0 }
    );
    out
}

/// Adds the predicted seconds of `g`'s ops to `into` by op name, as the interpreter
/// profiles them: a call of an IR function (`g.callees`) adds its body's ops, a call of
/// a C kernel counts as `@callee`.
fn predict_ops(
    g: &Graph,
    mesh: Option<&nnscaler_dialects::nns::Mesh>,
    cluster: &nnscaler_passes::planner::cost::Cluster,
    into: &mut std::collections::HashMap<String, f64>,
    (depth, drift): (usize, &mut nnscaler_passes::planner::cost::Drift),
) {
    for n in &g.nodes {
        if n.op == "func.call" {
            let Some(c) = nnscaler_dialects::userop::callee(&n.attrs) else {
                continue;
            };
            match g.callees.get(c) {
                Some(f) if depth < 64 => predict_ops(f, mesh, cluster, into, (depth + 1, drift)),
                Some(_) => {}
                None => {
                    if let Some(cost) =
                        nnscaler_passes::planner::cost::node_cost(g, n, cluster, mesh)
                    {
                        *into.entry(format!("@{c}")).or_default() +=
                            drift.charge(&cluster.device, &cost);
                    }
                }
            }
        } else if let Some(cost) = nnscaler_passes::planner::cost::node_cost(g, n, cluster, mesh) {
            // A collective with its expected wait for the group's slowest member.
            *into.entry(n.op.to_string()).or_default() += drift.charge(&cluster.device, &cost);
        }
    }
}

/// With `--repeat N > 1`: the median and fastest run, and of `device_times` (the
/// simulated devices' own time when `devices`, else the single device's CPU time under
/// serial timing), on stderr.
fn report_times(
    name: &str,
    times: &mut [f64],
    device_times: &mut [f64],
    (timing, devices): (&str, bool),
) {
    if times.len() > 1 {
        times.sort_by(f64::total_cmp);
        device_times.sort_by(f64::total_cmp);
        let devices = device_times
            .get(device_times.len() / 2)
            .map(|t| {
                format!(
                    "; {}: median {t:.6} s, fastest {:.6} s",
                    match (devices, timing == "serial") {
                        (true, true) => "the simulated devices (serial timing)",
                        (true, false) => "the simulated devices",
                        // One device: only serial timing records its CPU time.
                        (false, _) => "its CPU time (serial timing)",
                    },
                    device_times[0]
                )
            })
            .unwrap_or_default();
        eprintln!(
            "ran @{name} {} times: median {:.6} s, fastest {:.6} s{devices}",
            times.len(),
            times[times.len() / 2],
            times[0]
        );
    }
}

/// With `--repeat N > 1` on a compiled backend: the median and fastest of the launch
/// plan's runs (nnscaler-rt's step time), on stderr.
fn report_compiled(name: &str, a: &RunArgs, times: &mut [f64]) {
    if times.len() > 1 {
        times.sort_by(f64::total_cmp);
        eprintln!(
            "ran @{name} {} times on the {} backend{}: median {:.6} s, fastest {:.6} s (the launch plan's steps)",
            times.len(),
            a.backend,
            if a.ranks { ", a thread per device" } else { "" },
            times[times.len() / 2],
            times[0]
        );
    }
}

/// The parameters to write (`--save-params`): the path and the serialized tensors.
type SavedParams = (String, Vec<u8>);

/// Binds the tensor files and parameters (a file, or drawn from the seed) to `view`'s
/// arguments (whole tensors); with `--save-params`, also the parameters used, serialized
/// now (the run consumes the values) to be written only once the run succeeded.
fn bind_all(
    a: &RunArgs,
    view: &Graph,
) -> Result<(Vec<nnscaler_runtime::Tensor>, Option<SavedParams>), String> {
    let has_params = view.args.iter().any(|x| x.is_state());
    let params = match (&a.params, a.init_seed) {
        (Some(p), _) => ParamSource::File(p.clone(), io::load(Path::new(p))?),
        (None, Some(s)) => ParamSource::Seed(s),
        (None, None) if has_params => {
            return Err(format!(
                "@{} has parameters: give --params FILE or --init-seed S",
                view.name
            ))
        }
        (None, None) => ParamSource::Seed(0),
    };
    let (inputs_file, stored) = match &a.inputs {
        Some(f) => (f.clone(), io::load(Path::new(f))?),
        None => ("(no --inputs)".to_string(), Vec::new()),
    };
    let values = bind(view, &inputs_file, stored, &params)?;
    let saved_params = match &a.save_params {
        Some(path) => {
            let named: Vec<(String, Elem, &nnscaler_runtime::Tensor)> = view
                .args
                .iter()
                .zip(&values)
                .filter(|(x, _)| x.is_state())
                .map(|(x, t)| {
                    (
                        x.name().unwrap_or("").to_string(),
                        view.values[x.value].elem,
                        t,
                    )
                })
                .collect();
            Some((path.clone(), io::to_bytes(&named)?))
        }
        None => None,
    };
    Ok((values, saved_params))
}

/// What ran where, for the summary line.
struct Ran {
    name: String,
    place: String,
    /// The median run's seconds.
    seconds: f64,
}

impl Ran {
    fn new(name: &str, place: String, times: &[f64]) -> Ran {
        let mut t = times.to_vec();
        t.sort_by(f64::total_cmp);
        Ran {
            name: name.to_string(),
            place,
            seconds: t.get(t.len() / 2).copied().unwrap_or(0.0),
        }
    }
}

/// A compiled backend's place in the summary line.
fn compiled_place(a: &RunArgs, devices: u64) -> String {
    format!(
        "the {} backend, {devices} device{}{}",
        a.backend,
        if devices == 1 { "" } else { "s" },
        if a.ranks { ", a thread each" } else { "" }
    )
}

/// The summary line of a successful run: where it ran, how long it took, the scalar
/// results (such as the loss) and where everything went.
fn summary(a: &RunArgs, ran: &Ran, named: &[(String, Elem, &nnscaler_runtime::Tensor)]) -> String {
    const SHOWN: usize = 4;
    let scalars: Vec<String> = named
        .iter()
        .filter(|(_, _, t)| t.shape.is_empty())
        .filter_map(|(n, _, t)| match t.f() {
            Ok([x]) => Some(format!("{n} = {x}")),
            _ => None,
        })
        .collect();
    let mut s = format!("ran @{} on {} in {:.3} s", ran.name, ran.place, ran.seconds);
    if !scalars.is_empty() {
        s += ": ";
        s += &scalars[..scalars.len().min(SHOWN)].join(", ");
        if scalars.len() > SHOWN {
            s += &format!(" (and {} more scalars)", scalars.len() - SHOWN);
        }
    }
    s += &format!(
        "; {} result{} in {}",
        named.len(),
        if named.len() == 1 { "" } else { "s" },
        a.output
    );
    if let Some(p) = &a.save_params {
        s += &format!(", the parameters in {p}");
    }
    s
}

/// Writes the results of `g` (and the parameters, when asked) once everything succeeded,
/// then says so in one line (on stderr when the results go to standard output).
fn write_results(
    a: &RunArgs,
    g: &Graph,
    outs: &[nnscaler_runtime::Tensor],
    saved_params: Option<SavedParams>,
    ran: &Ran,
) -> Result<(), String> {
    let named: Vec<(String, Elem, &nnscaler_runtime::Tensor)> = g
        .outputs
        .iter()
        .zip(outs)
        .enumerate()
        .map(|(i, (o, t))| {
            (
                o.name()
                    .map(str::to_string)
                    .unwrap_or_else(|| format!("out{i}")),
                g.values[o.value].elem,
                t,
            )
        })
        .collect();
    let results = io::to_bytes(&named)?;
    let mut outputs = Outputs::new();
    if let Some((path, bytes)) = saved_params {
        outputs.stage(&path, bytes)?;
    }
    outputs.stage(&a.output, results)?;
    outputs.commit()?;
    let line = summary(a, ran, &named);
    if a.output == "-" || a.output == "/dev/stdout" {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
    Ok(())
}

/// The cluster `--profile` predicts for (refused with a compiled backend).
fn profile_cluster(a: &RunArgs) -> Result<Option<nnscaler_passes::planner::cost::Cluster>, String> {
    match &a.profile {
        Some(_) if a.backend != "reference" => Err(
            "--profile needs --backend reference (compiled kernels are timed as a whole)".into(),
        ),
        Some(c) => nnscaler_passes::planner::cost::load(c).map(Some),
        None => Ok(None),
    }
}

/// Runs pipeline `name`: its per-rank programs on the simulated devices of the mesh, with
/// whole tensors bound to the original function's arguments.
fn run_pipelined(
    a: &RunArgs,
    module: &melior::ir::Module<'_>,
    all: Vec<Graph>,
    name: &str,
    render: &dyn Fn(Diagnostics) -> String,
) -> Result<(), String> {
    let model = &a.model;
    if a.autodiff {
        return Err(format!(
            "--autodiff: @{name} is a pipelined step; differentiate before partitioning"
        ));
    }
    let mut d = Diagnostics::default();
    let meshes = Meshes::collect(&module.as_operation(), &mut d);
    let mesh = meshes.resolve(None).map_err(|e| format!("{model}: {e}"))?;
    if let Some(n) = a.devices.filter(|&n| n != mesh.devices()) {
        return Err(format!(
            "--devices {n}, but pipeline @{name} runs on mesh '@{}' of {} devices",
            mesh.name,
            mesh.devices()
        ));
    }
    let programs = pipeline_programs(&all, name).map_err(|e| format!("{model}: {e}"))?;
    let axis = crate::compile::pipeline_axis(&programs);
    if mesh.axis(&axis).is_none() && programs.len() == 1 {
        return Err(format!(
            "{model}: mesh '@{}' has no pipeline axis '{axis}'",
            mesh.name
        ));
    }
    let dmesh = mesh.device_mesh();
    let PipelineStep {
        step,
        arg_index,
        res_index,
        ..
    } = pipeline_step(&programs, name, &dmesh).map_err(|e| format!("{model}: {e}"))?;
    let need = memory::estimate(&step, &step, 1);
    memory::check(
        &need,
        a.memory_limit,
        mesh.devices() as u64 + u64::from(a.threads) - 1,
    )
    .map_err(|e| format!("{model}: @{name}: {e}"))?;
    let (values, saved_params) = bind_all(a, &step)?;
    let inputs: std::collections::BTreeMap<usize, nnscaler_runtime::Tensor> =
        arg_index.iter().copied().zip(values).collect();
    let cluster = profile_cluster(a)?;
    if a.backend != "reference" {
        if a.check_finite {
            return Err("--check-finite needs --backend reference (compiled kernels are not checked op by op)".into());
        }
        let compiled =
            crate::compile::Compiled::pipeline(&programs, mesh, &axis, model, &a.backend)
                .map_err(|e| format!("{model}: pipeline @{name}: {e}"))?
                .with_ranks(a.ranks);
        let (outs, mut times) = compiled
            .run_indexed_timed(&inputs, a.repeat as usize)
            .map_err(|e| format!("{model}: pipeline @{name}: {e}"))?;
        report_compiled(name, a, &mut times);
        let place = format!(
            "{} ({} pipeline ranks)",
            compiled_place(a, mesh.devices() as u64),
            programs.len()
        );
        let ran = Ran::new(name, place, &times);
        return write_results(a, &step, &outs, saved_params, &ran);
    }
    let opts = Options {
        check_finite: a.check_finite,
        profile_devices: cluster.is_some(),
        serial_devices: a.timing == "serial",
    };
    // Per rank, its devices' op times added up (the tables show their mean).
    let dsizes: Vec<i64> = dmesh.axes.iter().map(|x| x.size).collect();
    let ppi = dmesh.axes.iter().position(|x| x.name == axis);
    let mut profiles = vec![nnscaler_runtime::Profile::default(); programs.len()];
    let mut times = Vec::new();
    let mut device_times = Vec::new();
    let mut outs = Default::default();
    for run in 0..a.repeat.max(1) {
        let started = std::time::Instant::now();
        outs = run_pipeline(&programs, mesh, &axis, &inputs, &opts).map_err(|e| {
            let mut d = Diagnostics::default();
            d.error(&e.loc, e.message);
            render(d)
        })?;
        times.push(started.elapsed().as_secs_f64());
        device_times.push(nnscaler_runtime::spmd::device_seconds());
        // With --repeat, the first run warms up and is left out.
        if cluster.is_some() && (run > 0 || a.repeat <= 1) {
            for (d, p) in nnscaler_runtime::spmd::device_profiles().iter().enumerate() {
                let r = ppi.map_or(0, |i| nnscaler_dialects::sharding::coords(&dsizes, d)[i]);
                if let Some(acc) = profiles.get_mut(r) {
                    acc.merge(p);
                }
            }
        }
    }
    report_times(name, &mut times, &mut device_times, (&a.timing, true));
    let place = format!(
        "the reference runtime, {} simulated devices ({} pipeline ranks)",
        mesh.devices(),
        programs.len()
    );
    let ran = Ran::new(name, place, &times);
    if let Some(c) = &cluster {
        let runs = if a.repeat > 1 { a.repeat - 1 } else { 1 };
        let per_rank = (mesh.devices() as u32 / programs.len().max(1) as u32).max(1);
        for (g, p) in programs.iter().zip(&profiles) {
            eprint!("{}", profile_table(g, Some(mesh), c, p, (runs, per_rank)));
        }
    }
    let outs: Vec<nnscaler_runtime::Tensor> = res_index
        .iter()
        .map(|i| outs.remove(i).expect("every result is assembled"))
        .collect();
    write_results(a, &step, &outs, saved_params, &ran)
}

/// A pipelined step as one function: the programs' arguments and results in the original
/// function's order (what tensor files bind against), and where each sits.
pub(crate) struct PipelineStep {
    /// The step's signature (no body): whole types, the programs' attributes.
    pub step: Graph,
    /// The original argument index of each of `step`'s arguments (`nns.arg`).
    pub arg_index: Vec<usize>,
    /// The original result index of each of `step`'s results (`nns.result`).
    pub res_index: Vec<usize>,
    /// Per argument of `step`, the (program, argument) pairs that take it.
    pub arg_uses: Vec<Vec<(usize, usize)>>,
}

/// Assembles pipeline `name`'s step from its per-rank `programs` (`dmesh`: the device
/// mesh, the micro-batch axis left out).
pub(crate) fn pipeline_step(
    programs: &[Graph],
    name: &str,
    dmesh: &nnscaler_dialects::nns::Mesh,
) -> Result<PipelineStep, String> {
    use nnscaler_dialects::types::{AttrValue, Attrs, TensorType};
    use std::collections::BTreeMap;
    let mut step = Graph {
        name: name.to_string(),
        ..Graph::default()
    };
    // Per original argument index: its whole type, attributes and (program, argument)s.
    type Slot = (TensorType, Attrs, Vec<(usize, usize)>);
    let mut arg_slots: BTreeMap<usize, Slot> = BTreeMap::new();
    let mut res_slots: BTreeMap<usize, (TensorType, Attrs)> = BTreeMap::new();
    for (pi, p) in programs.iter().enumerate() {
        let view = global_view(p, dmesh).map_err(|e| format!("@{}: {e}", p.name))?;
        for (k, x) in view.args.iter().enumerate() {
            if let Some(AttrValue::Int(i)) = x.attrs.get("nns.arg") {
                let mut attrs = x.attrs.clone();
                // Seeded init decides a parameter's rule by its uses, which are inside the
                // fragments the program calls: ask the program, make it explicit.
                if x.is_state() && !attrs.contains_key("nns.init") {
                    let rule = p.init_rule(k).map_err(|e| format!("@{}: {e}", p.name))?;
                    attrs.insert("nns.init".into(), AttrValue::Str(rule.to_string()));
                }
                let slot = arg_slots
                    .entry(*i as usize)
                    .or_insert_with(|| (view.values[x.value].clone(), attrs, Vec::new()));
                slot.2.push((pi, k));
            }
        }
        for o in &view.outputs {
            if let Some(AttrValue::Int(i)) = o.attrs.get("nns.result") {
                res_slots.insert(*i as usize, (view.values[o.value].clone(), o.attrs.clone()));
            }
        }
    }
    let arg_index: Vec<usize> = arg_slots.keys().copied().collect();
    let mut arg_uses = Vec::new();
    for (ty, attrs, uses) in arg_slots.into_values() {
        step.add_arg(ty, attrs);
        arg_uses.push(uses);
    }
    let res_index: Vec<usize> = res_slots.keys().copied().collect();
    for (ty, attrs) in res_slots.into_values() {
        let value = step.new_value(ty);
        step.outputs
            .push(nnscaler_dialects::graph::Output { value, attrs });
    }
    Ok(PipelineStep {
        step,
        arg_index,
        res_index,
        arg_uses,
    })
}

/// The function `nnscaler run MODEL [--func NAME]` runs among `names` (the module's
/// functions, in order): NAME, else the only one, else `@train`.
fn pick_function<S: AsRef<str>>(
    names: &[S],
    func: Option<&str>,
    model: &str,
) -> Result<usize, String> {
    let list = || {
        names
            .iter()
            .map(AsRef::as_ref)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let find = |want: &str| names.iter().position(|n| n.as_ref() == want);
    match func {
        Some(f) => {
            find(f).ok_or_else(|| format!("{model}: no function @{f} (functions: {})", list()))
        }
        None if names.len() == 1 => Ok(0),
        None => find("train").ok_or_else(|| {
            format!(
                "{model}: several functions ({}); choose one with --func",
                list()
            )
        }),
    }
}

/// An argument of the step `nnscaler run` would run: its name, whole type, whether it is
/// trained state (parameters and optimizer state, which come from --params or
/// --init-seed) and the values it may hold.
pub(crate) struct StepArg {
    pub name: String,
    pub ty: nnscaler_dialects::types::TensorType,
    pub state: bool,
    pub domain: Option<nnscaler_dialects::domain::Domain>,
}

/// The arguments of the step `nnscaler run MODEL [--func NAME]` runs, as it binds tensor
/// files to them: a single-device function's own, a localized function's whole tensors,
/// a pipelined step's in the original function's order.
pub(crate) fn step_args(
    module: &melior::ir::Module<'_>,
    model: &str,
    func: Option<&str>,
) -> Result<(String, Vec<StepArg>), String> {
    use nnscaler_dialects::domain;
    let all: Vec<Graph> = Graph::all_in(module)
        .into_iter()
        .filter_map(Result::ok)
        .collect();
    if all.is_empty() {
        return Err(format!("{model}: the module has no function"));
    }
    let names: Vec<&str> = all.iter().map(|g| g.name.as_str()).collect();
    let arg = |x: &nnscaler_dialects::graph::Arg, i: usize, ty, domain| StepArg {
        name: x.name().map(str::to_string).unwrap_or(format!("arg{i}")),
        ty,
        state: x.is_state(),
        domain,
    };
    let mut d = Diagnostics::default();
    let meshes = Meshes::collect(&module.as_operation(), &mut d);
    if let Some(name) = crate::compile::pipeline_named(&all, func) {
        let mesh = meshes.resolve(None).map_err(|e| format!("{model}: {e}"))?;
        let programs = pipeline_programs(&all, &name).map_err(|e| format!("{model}: {e}"))?;
        let p = pipeline_step(&programs, &name, &mesh.device_mesh())
            .map_err(|e| format!("{model}: {e}"))?;
        let args = p
            .step
            .args
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let found = p.arg_uses[i]
                    .iter()
                    .filter_map(|&(pi, k)| domain::of_arg(&programs[pi], k));
                let dom = found.reduce(|a, b| match (a, b) {
                    (domain::Domain::Below(m), domain::Domain::Below(n)) => {
                        domain::Domain::Below(m.max(n))
                    }
                    (a, _) => a,
                });
                arg(x, p.arg_index[i], p.step.values[x.value].clone(), dom)
            })
            .collect();
        return Ok((name, args));
    }
    let pick = pick_function(&names, func, model)?;
    let mut g = all[pick].clone();
    g.link(&all);
    let view = if g.is_localized() {
        let mesh = meshes.resolve(None).map_err(|e| format!("{model}: {e}"))?;
        global_view(&g, mesh).map_err(|e| format!("{model}: @{}: {e}", g.name))?
    } else {
        g.clone()
    };
    let args = view
        .args
        .iter()
        .enumerate()
        .map(|(i, x)| arg(x, i, view.values[x.value].clone(), domain::of_arg(&g, i)))
        .collect();
    Ok((g.name.clone(), args))
}

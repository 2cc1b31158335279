//! `nnscaler-rt`: runs a compiled program (`nnscaler compile` makes the `.nnsx` artifact).

use clap::{Parser, Subcommand};
use nnscaler_rt::artifact::Step;
use nnscaler_rt::tensor::{self, Tensor};
use nnscaler_rt::{Artifact, HostProgram};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "nnscaler-rt",
    version,
    about = "Run a compiled nnscaler program (.nnsx, made by 'nnscaler compile')",
    long_about = "Run a compiled nnscaler program (.nnsx, made by 'nnscaler compile'). \
        It needs no MLIR or LLVM: copy this binary and the artifact to a machine and run. \
        Backends: host (the artifact's kernels compiled for the CPU, every device of a \
        partitioned program a virtual device) and cuda (the PTX on GPU 0, every device of \
        the mesh a virtual device on it; in binaries built with --features cuda). With \
        run --ranks every device runs on a thread of its own instead (cuda: on a GPU of \
        its own, collectives and messages through NCCL, or on a stream of its own on one \
        GPU)."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Print an artifact's signature, memory plan and steps, or a training bundle's
    /// summary (its files checked against their checksums).
    Info {
        /// The artifact, or a bundle's directory.
        artifact: String,
    },
    /// Run a program once: arguments from safetensors files by name, results to one.
    Run {
        /// The artifact.
        artifact: String,
        /// Tensors for the arguments, by name (repeatable; later files override). Each must
        /// have its argument's shape and type, and hold values its ops accept (ids below
        /// the table's rows or the logits' classes, AdamW's step from 1; `info` shows them).
        #[arg(long = "inputs", value_name = "FILE.safetensors", required = true)]
        inputs: Vec<String>,
        /// Where to write the results (safetensors, by name), written only on success.
        #[arg(short = 'o', long = "output", value_name = "FILE")]
        output: String,
        /// Run the step this many times and report the median and fastest step time.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10000))]
        repeat: u32,
        /// Where the kernels run: host, or cuda (binaries built with --features cuda).
        #[arg(long, default_value = "host", value_parser = ["host", "cuda"])]
        backend: String,
        /// Run every device on a thread of its own, as ranks of a cluster do, instead of
        /// all devices in lockstep on one thread: collectives through a communicator,
        /// messages matched in order as NCCL matches them (on lanes where a schedule
        /// receives in another order than it sends); a deadlock is reported, naming what
        /// each device waits for. host: the in-process communicator (results the same
        /// bits as without --ranks; the devices compute at once). cuda: =gpus puts device
        /// d on GPU d, collectives and messages through NCCL (as many GPUs as devices);
        /// =streams makes every device a stream of its own on GPU 0 (collectives by
        /// device copies and reducer kernels summing in member order, as without
        /// --ranks); =auto (the
        /// default) takes gpus where there are enough GPUs and NCCL loads, else streams.
        #[arg(long, value_name = "ON", num_args = 0..=1, require_equals = true,
              default_missing_value = "auto", value_parser = ["auto", "gpus", "streams"])]
        ranks: Option<String>,
        /// Refuse to start when the program's arenas (every program's, on every device)
        /// need more than this (e.g. 8G, 512M, or bytes); without it, more than the host's
        /// available memory (host) or the GPU's free memory (cuda) is refused.
        #[arg(long, value_name = "BYTES", value_parser = nnscaler_rt::memory::parse_bytes)]
        memory_limit: Option<u64>,
        /// After the runs, one more with every step timed (CUDA events on the GPU, the
        /// clock on the host), printed as a table by kernel family: time, share,
        /// launches, and GB/s (the bytes of the buffers it touches, each once) and
        /// TFLOP/s (matrix products) where the kernel knows them. Not with --ranks.
        #[arg(long)]
        profile: bool,
        /// How f32 matrix products round on the GPU (as torch.set_float32_matmul_precision):
        /// highest computes them in f32 (no TF32); high lets cuBLAS use TF32 tensor cores
        /// (inputs to 10 mantissa bits, about 1e-3 relative, several times faster). bf16
        /// products are bf16 either way; the host computes in f32 either way.
        #[arg(long, default_value = "highest", value_name = "P", value_parser = ["highest", "high"])]
        matmul_precision: String,
        /// Capture the step's launches once as a CUDA graph and replay it for every run
        /// after the first (cuda; no launch overhead per kernel). The arguments are copied
        /// into the same arena before each run; a step the graph cannot capture (the
        /// driver says why) runs launch by launch, as without it. The host has no launch
        /// overhead to save: there it changes nothing.
        #[arg(long)]
        graph: bool,
    },
    /// Run a program once on the GPU and on the host in lockstep, comparing what every
    /// step writes (a kernel's outputs, a collective's, a received buffer) on every
    /// device; print the kernels that agree least and the first step over the
    /// tolerance, and exit 1 if there is one (binaries built with --features cuda).
    Compare {
        /// The artifact.
        artifact: String,
        /// Tensors for the arguments, by name (repeatable; later files override).
        #[arg(long = "inputs", value_name = "FILE.safetensors", required = true)]
        inputs: Vec<String>,
        /// The largest error allowed: a buffer's largest difference over its largest
        /// magnitude on the host.
        #[arg(long, default_value_t = 1e-4)]
        tolerance: f64,
        /// How many kernels to list, worst first.
        #[arg(long, default_value_t = 12)]
        top: usize,
        /// Let the GPU's values run on: each step starts from the GPU's own results, so
        /// errors accumulate as in a real run (by default each step starts from the
        /// host's values of its inputs, and its error is its own).
        #[arg(long)]
        drift: bool,
    },
    /// Train a bundle ('nnscaler train --config F.toml --bundle DIR' makes it): the loop
    /// of 'nnscaler train' (the same batches, schedule, evaluation, log, checkpoints and
    /// loss curve; paths in the config are relative to where this runs). As one of several
    /// processes, where a launcher set torchrun's variables (RANK, WORLD_SIZE,
    /// LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or Slurm's (SLURM_PROCID, SLURM_NTASKS,
    /// SLURM_LOCALID, SLURM_JOB_NODELIST), it meets the others at MASTER_ADDR:MASTER_PORT
    /// and runs its share of the mesh's devices; rank 0 evaluates, logs and writes.
    Train {
        /// The bundle's directory.
        bundle: String,
        /// Continue from the checkpoint in the config's checkpoint.dir, exactly.
        #[arg(long)]
        resume: bool,
        /// Stop after this step (checkpointing there), as if the run were stopped;
        /// --resume continues it exactly.
        #[arg(long, value_name = "STEP")]
        until: Option<u64>,
        /// Where the kernels run: host, or cuda (GPU LOCAL_RANK; binaries built with
        /// --features cuda).
        #[arg(long, default_value = "host", value_parser = ["host", "cuda"])]
        backend: String,
        /// One process: every device on a thread of its own instead of lockstep (as
        /// 'run --ranks'; the same results on the host).
        #[arg(long, value_name = "ON", num_args = 0..=1, require_equals = true,
              default_missing_value = "auto", value_parser = ["auto", "gpus", "streams"])]
        ranks: Option<String>,
        /// How the processes find rank 0: tcp (rank 0 listens at MASTER_ADDR:MASTER_PORT)
        /// or file:PATH (rank 0 writes its address into PATH on a shared file system; the
        /// others read it).
        #[arg(long, default_value = "tcp", value_name = "HOW")]
        rendezvous: String,
        /// Seconds a process waits for the others: at the rendezvous (then the ranks that
        /// never arrived are named) and for any message during training (then the rank
        /// that never sent it is named).
        #[arg(long, default_value_t = 600, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..))]
        timeout: u64,
        /// Stop after the step during which this many seconds of training passed,
        /// evaluating and checkpointing there (a job's time limit); --resume continues.
        #[arg(long, value_name = "SECONDS")]
        max_time: Option<f64>,
        /// Refuse to start when the training step's and the evaluation forward's arenas
        /// and tensors need more than this (e.g. 8G); without it, more than the host's
        /// available memory (host) or the GPU's free memory (cuda) is refused.
        #[arg(long, value_name = "BYTES", value_parser = nnscaler_rt::memory::parse_bytes)]
        memory_limit: Option<u64>,
        /// Print a progress line on stderr (step, loss, tokens/s, time left) at most every
        /// this many seconds, and after the last step (rank 0 only). Default: 30 where
        /// stderr is not a terminal (a job's log), none on a terminal (the progress bar
        /// shows there); 0: every step.
        #[arg(long, value_name = "SECONDS")]
        progress_every: Option<f64>,
        /// How f32 matrix products round on the GPU (as torch.set_float32_matmul_precision):
        /// highest computes them in f32 (no TF32); high lets cuBLAS use TF32 tensor cores
        /// (inputs to 10 mantissa bits, about 1e-3 relative, several times faster). bf16
        /// products are bf16 either way; the host computes in f32 either way.
        #[arg(long, default_value = "highest", value_name = "P", value_parser = ["highest", "high"])]
        matmul_precision: String,
    },
    /// Time the calibration benchmarks 'nnscaler calibrate --device gpu --prepare DIR'
    /// wrote, and write them back with each one's median seconds (for 'nnscaler
    /// calibrate --device gpu --timings FILE' to fit).
    Bench {
        /// The manifest (DIR/calibrate.json).
        manifest: String,
        /// Where to write the timed manifest (JSON), written only on success.
        #[arg(short = 'o', long = "output", value_name = "FILE")]
        output: String,
        /// Timed runs of each benchmark (after one warm-up run).
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
        runs: u32,
        /// Where the kernels run: host, or cuda (binaries built with --features cuda).
        #[arg(long, default_value = "cuda", value_parser = ["host", "cuda"])]
        backend: String,
    },
}

fn load(path: &str) -> Result<Artifact, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
    Artifact::from_bytes(&bytes, path)
}

/// A training bundle's summary (its files checked).
fn bundle_info(path: &str) -> Result<String, String> {
    let b = nnscaler_rt::train::Bundle::open(path)?;
    let m = &b.manifest;
    let l = &m.run;
    let elements: u64 = m
        .state
        .iter()
        .map(|s| s.shape.iter().product::<u64>())
        .sum();
    let bytes: u64 = m.files.iter().map(|f| f.bytes).sum();
    let mut s = format!(
        "{path}: training bundle (format {}) of {}: {} steps{} of batch {} x block {}, on {} device{}; state {} tensors ({elements} elements){}; {} files, {bytes} bytes, checksums good\n",
        m.version,
        m.source,
        l.steps,
        if m.start > 0 { format!(" from step {}", m.start) } else { String::new() },
        l.batch,
        l.block,
        m.devices,
        if m.devices == 1 { "" } else { "s" },
        m.state.len(),
        if m.state.iter().any(|s| s.init == nnscaler_rt::train::Init::Stored) {
            ", from init.safetensors"
        } else {
            ", drawn from the seed"
        },
        m.files.len(),
    );
    for f in &m.files {
        s += &format!("file {} {} bytes\n", f.path, f.bytes);
    }
    Ok(s)
}

fn info(path: &str) -> Result<String, String> {
    if std::path::Path::new(path).is_dir() {
        return bundle_info(path);
    }
    let a = load(path)?;
    let h = &a.header;
    let arena = h.programs.iter().map(|p| p.arena_bytes).max().unwrap_or(0);
    let mut s = format!(
        "{path}: {} for sm_{} (PTX {}.{}); {} kernels, {} steps, arena {} bytes\n",
        h.source,
        h.target.sm,
        h.target.ptx / 10,
        h.target.ptx % 10,
        h.kernels.len(),
        a.steps(),
        arena
    );
    let axes: Vec<String> = h
        .mesh
        .iter()
        .map(|a| format!("{} = {}", a.name, a.size))
        .collect();
    match &h.pipeline_axis {
        Some(axis) => {
            s += &format!(
                "a pipeline of {} programs (one per rank of '{axis}'), run on {} virtual devices: mesh <{}>\n",
                h.programs.len(),
                a.devices(),
                axes.join(", ")
            );
            for p in &h.programs {
                let sends = p
                    .steps
                    .iter()
                    .filter(|s| matches!(s, Step::Send { .. }))
                    .count();
                let recvs = p
                    .steps
                    .iter()
                    .filter(|s| matches!(s, Step::Recv { .. }))
                    .count();
                s += &format!(
                    "program {} on devices {:?}: {} steps ({sends} sends, {recvs} receives), arena {} bytes\n",
                    p.name,
                    p.devices,
                    p.steps.len(),
                    p.arena_bytes
                );
            }
            // The messages of each pair of programs and the lanes --ranks matches them on.
            let lanes = nnscaler_rt::lanes(&a)?;
            let mut pairs = std::collections::BTreeMap::new();
            for (pi, p) in h.programs.iter().enumerate() {
                for (st, &lane) in p.steps.iter().zip(&lanes[pi]) {
                    if let Step::Send { to, .. } = st {
                        let e = pairs.entry((pi, *to)).or_insert((0usize, 0usize));
                        e.0 += 1;
                        e.1 = e.1.max(lane + 1);
                    }
                }
            }
            for ((from, to), (n, l)) in pairs {
                s += &format!(
                    "messages {} -> {}: {n} on {l} lane{} (matched in order within a lane under --ranks)\n",
                    h.programs[from].name,
                    h.programs[to].name,
                    if l == 1 { "" } else { "s" }
                );
            }
        }
        None if !h.mesh.is_empty() => {
            s += &format!(
                "one device's program, run on {} virtual devices: mesh <{}>\n",
                a.devices(),
                axes.join(", ")
            );
        }
        None => {}
    }
    for (what, ports, inputs) in [("input", &h.inputs, true), ("output", &h.outputs, false)] {
        for (k, p) in ports.iter().enumerate() {
            // The piece of the first program that holds it.
            let piece = h.programs.iter().find_map(|prog| {
                let bindings = if inputs { &prog.inputs } else { &prog.outputs };
                bindings
                    .iter()
                    .find(|b| b.port == k)
                    .map(|b| &prog.buffers[b.buffer].shape)
            });
            let piece = match piece {
                Some(shape) if *shape != p.global_shape => format!(" (piece {shape:?})"),
                Some(_) => String::new(),
                None => " (unused)".into(),
            };
            let domain = match p.domain {
                Some(nnscaler_rt::artifact::Domain::Below(n)) => format!(" (ids below {n})"),
                Some(nnscaler_rt::artifact::Domain::AtLeast(m)) => format!(" (at least {m})"),
                None => String::new(),
            };
            s += &format!(
                "{what} {} {:?} {:?}{piece}{}{domain}\n",
                p.name,
                p.elt,
                p.global_shape,
                if p.param { " (param)" } else { "" }
            );
        }
    }
    for (name, bytes) in &a.sections {
        s += &format!("section {name}: {} bytes\n", bytes.len());
    }
    Ok(s)
}

/// The artifact's arguments, by name, from `inputs` (later files override).
fn arguments(a: &Artifact, inputs: &[String]) -> Result<Vec<Tensor>, String> {
    let mut given = std::collections::BTreeMap::new();
    for f in inputs {
        given.extend(tensor::read(f)?);
    }
    let args: Vec<Tensor> = a
        .header
        .inputs
        .iter()
        .map(|p| {
            given.remove(&p.name).ok_or_else(|| {
                format!(
                    "no tensor '{}' in {} (the program's argument)",
                    p.name,
                    inputs.join(", ")
                )
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(args)
}

#[allow(clippy::too_many_arguments)]
fn run(
    path: &str,
    inputs: &[String],
    output: &str,
    backend: &str,
    repeat: usize,
    on: Option<&str>,
    memory_limit: Option<u64>,
    (profile, graph): (bool, bool),
) -> Result<String, String> {
    let ranks = on.is_some();
    if graph && ranks {
        return Err("--graph replays the lockstep run: leave out --ranks".into());
    }
    if profile && ranks {
        return Err("--profile times the lockstep run: leave out --ranks".into());
    }
    if backend != "cuda" && matches!(on, Some("gpus" | "streams")) {
        return Err(format!(
            "--ranks={} places ranks on GPUs: it needs --backend cuda",
            on.unwrap_or_default()
        ));
    }
    let a = load(path)?;
    // The arenas against --memory-limit, or the host's memory (the GPU's free memory is
    // checked when the CUDA backend opens the device).
    let available = match (memory_limit, backend) {
        (None, "host") => nnscaler_rt::memory::host_available(),
        _ => None,
    };
    nnscaler_rt::memory::check(&a, memory_limit, available).map_err(|e| format!("{path}: {e}"))?;
    let args = arguments(&a, inputs)?;
    let names: Vec<String> = a.header.outputs.iter().map(|p| p.name.clone()).collect();
    let devices = a.devices();
    let profiled = profile.then(|| a.clone());
    let (outs, mut times) = match (backend, ranks) {
        ("cuda", false) => run_cuda(a, &args, repeat, graph)?,
        ("cuda", true) => run_cuda_ranks(a, &args, repeat, on.unwrap_or("auto"))?,
        (_, false) => HostProgram::load(a)?.run_timed(&args, repeat)?,
        (_, true) => HostProgram::load(a)?.run_ranks_timed(&args, repeat)?,
    };
    times.sort_by(f64::total_cmp);
    let secs = times[times.len() / 2];
    let timing = if times.len() > 1 {
        format!(
            " (median of {} runs; fastest {:.6} s)",
            times.len(),
            times[0]
        )
    } else {
        String::new()
    };
    let table = match profiled {
        Some(a) => profile_run(a, &args, backend)?.table(),
        None => String::new(),
    };
    let named: Vec<(String, Tensor)> = names.into_iter().zip(outs).collect();
    write(output, &tensor::to_bytes(&named)?)?;
    let gpu_only = match (graph, nnscaler_rt::precision::tf32()) {
        _ if backend == "cuda" => "",
        (true, true) => " (--matmul-precision and --graph change nothing on the host)",
        (true, false) => " (--graph changes nothing on the host)",
        (false, true) => " (--matmul-precision changes nothing on the host)",
        (false, false) => "",
    };
    Ok(format!(
        "ran {path} on the {} ({} device{}{}) in {secs:.6} s{timing}; {} results in {output}{gpu_only}\n{table}",
        match (backend, ranks) {
            ("cuda", true) => "GPU(s)",
            ("cuda", false) => "GPU",
            _ => "host",
        },
        devices,
        if devices == 1 { "" } else { "s" },
        if ranks { ", a thread each" } else { "" },
        named.len()
    ))
}

/// One more run with every step timed ([`nnscaler_rt::profile`]).
fn profile_run(
    a: Artifact,
    args: &[Tensor],
    backend: &str,
) -> Result<nnscaler_rt::profile::Profile, String> {
    match backend {
        "cuda" => profile_cuda(a, args),
        _ => Ok(HostProgram::load(a)?.run_profiled(args)?.1),
    }
}

#[cfg(feature = "cuda")]
fn profile_cuda(a: Artifact, args: &[Tensor]) -> Result<nnscaler_rt::profile::Profile, String> {
    nnscaler_rt::cuda::CudaProgram::load(a, 0)?.run_profiled(args)
}

#[cfg(not(feature = "cuda"))]
fn profile_cuda(_: Artifact, _: &[Tensor]) -> Result<nnscaler_rt::profile::Profile, String> {
    Err("this nnscaler-rt was built without the CUDA backend (cargo build --release -p nnscaler-rt --features cuda)".into())
}

/// Runs on GPU 0 (the times cover the steps, not loading the PTX or copying tensors).
#[cfg(feature = "cuda")]
fn run_cuda(
    a: Artifact,
    args: &[Tensor],
    repeat: usize,
    graph: bool,
) -> Result<(Vec<Tensor>, Vec<f64>), String> {
    let prog = nnscaler_rt::cuda::CudaProgram::load(a, 0)?;
    eprintln!("nnscaler-rt: {}", prog.gemms());
    if graph {
        let (outs, times, how) = prog.run_timed_graph(args, repeat)?;
        eprintln!("nnscaler-rt: {how}");
        return Ok((outs, times));
    }
    prog.run_timed(args, repeat)
}

/// Runs as ranks on GPUs, placed by `on` (auto, gpus or streams); says where on stderr.
#[cfg(feature = "cuda")]
fn run_cuda_ranks(
    a: Artifact,
    args: &[Tensor],
    repeat: usize,
    on: &str,
) -> Result<(Vec<Tensor>, Vec<f64>), String> {
    let prog = nnscaler_rt::cuda::CudaProgram::load(a, 0)?;
    eprintln!("nnscaler-rt: {}", prog.gemms());
    let (outs, times, line) = nnscaler_rt::streams::run_ranks(&prog, args, repeat, on.parse()?)?;
    eprintln!("nnscaler-rt: {line}");
    Ok((outs, times))
}

#[cfg(not(feature = "cuda"))]
fn run_cuda_ranks(
    _: Artifact,
    _: &[Tensor],
    _: usize,
    _: &str,
) -> Result<(Vec<Tensor>, Vec<f64>), String> {
    Err("this nnscaler-rt was built without the CUDA backend (cargo build --release -p nnscaler-rt --features cuda)".into())
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(
    _: Artifact,
    _: &[Tensor],
    _: usize,
    _: bool,
) -> Result<(Vec<Tensor>, Vec<f64>), String> {
    Err("this nnscaler-rt was built without the CUDA backend (cargo build --release -p nnscaler-rt --features cuda)".into())
}

#[cfg(feature = "cuda")]
fn compare(
    path: &str,
    inputs: &[String],
    tol: f64,
    top: usize,
    drift: bool,
) -> Result<String, String> {
    let a = load(path)?;
    let args = arguments(&a, inputs)?;
    let gpu = nnscaler_rt::cuda::CudaProgram::load(a.clone(), 0)?;
    eprintln!("nnscaler-rt: {}", gpu.gemms());
    let host = HostProgram::load(a)?;
    let c = gpu.compare(&host, &args, !drift)?;
    let report = c.report(tol, top);
    match c.first_over(tol) {
        None => Ok(report),
        Some(d) => {
            print!("{report}");
            Err(format!(
                "{path}: the GPU disagrees with the host from step {} of '{}' ({}): error {:.3e} > {tol:e}",
                d.step, d.program, d.what, d.error
            ))
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn compare(_: &str, _: &[String], _: f64, _: usize, _: bool) -> Result<String, String> {
    Err("this nnscaler-rt was built without the CUDA backend (cargo build --release -p nnscaler-rt --features cuda)".into())
}

fn bench(manifest: &str, output: &str, runs: usize, backend: &str) -> Result<String, String> {
    let text = std::fs::read_to_string(manifest).map_err(|e| format!("{manifest}: {e}"))?;
    let mut m: nnscaler_rt::bench::Manifest = serde_json::from_str(&text)
        .map_err(|e| format!("{manifest}: not a calibration manifest ({e})"))?;
    let dir = std::path::Path::new(manifest)
        .parent()
        .unwrap_or(std::path::Path::new("."));
    let mut time = |a: Artifact, args: &[Tensor], n: usize| -> Result<Vec<f64>, String> {
        Ok(match backend {
            "cuda" => run_cuda(a, args, n, false)?.1,
            _ => HostProgram::load(a)?.run_timed(args, n)?.1,
        })
    };
    nnscaler_rt::bench::run(&mut m, dir, runs, &mut time, &mut |e| {
        let s = e.seconds.unwrap_or(0.0);
        let rate = match e.kind {
            nnscaler_rt::bench::Kind::Gemm
            | nnscaler_rt::bench::Kind::GemmBf16
            | nnscaler_rt::bench::Kind::Vector
            | nnscaler_rt::bench::Kind::Attention => {
                format!("{:.2} GFLOP/s", e.flops / s / 1e9)
            }
            nnscaler_rt::bench::Kind::Stream | nnscaler_rt::bench::Kind::Optimizer => {
                format!("{:.2} GB/s", e.bytes / s / 1e9)
            }
            nnscaler_rt::bench::Kind::Launch => {
                format!("{:.2} us a kernel", s / e.ops.max(1) as f64 * 1e6)
            }
        };
        eprintln!("nnscaler-rt: {}: {:.3e} s, {rate}", e.name, s);
    })?;
    m.backend = Some(backend.to_string());
    let json = serde_json::to_string_pretty(&m).map_err(|e| e.to_string())?;
    write(output, json.as_bytes())?;
    Ok(format!(
        "timed {} benchmarks on the {backend} backend ({runs} runs each, medians); {output}\n",
        m.entries.len()
    ))
}

/// Writes `bytes` to `path` whole or not at all: a regular file or a new path through a
/// temporary and a rename; anything else (`/dev/null`, a FIFO) written through.
fn write(path: &str, bytes: &[u8]) -> Result<(), String> {
    let p = std::path::Path::new(path);
    let special = std::fs::metadata(p).is_ok_and(|m| !m.is_file());
    if special {
        return std::fs::write(p, bytes).map_err(|e| format!("{path}: {e}"));
    }
    let tmp = p.with_file_name(format!(
        ".{}.{}.partial",
        p.file_name().and_then(|n| n.to_str()).unwrap_or("out"),
        std::process::id()
    ));
    std::fs::write(&tmp, bytes).map_err(|e| format!("{path}: {e}"))?;
    std::fs::rename(&tmp, p).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("{path}: {e}")
    })
}

fn train(
    bundle: &str,
    resume: bool,
    until: Option<u64>,
    backend: &str,
    ranks: Option<String>,
    rendezvous: &str,
    (timeout, max_time, memory_limit, progress_every): (u64, Option<f64>, Option<u64>, Option<f64>),
) -> Result<String, String> {
    use nnscaler_rt::net::{world_from, Rendezvous};
    let rendezvous = match rendezvous.split_once(':') {
        _ if rendezvous == "tcp" => Rendezvous::Tcp,
        Some(("file", path)) if !path.is_empty() => Rendezvous::File(path.to_string()),
        _ => return Err(format!("--rendezvous {rendezvous}: give tcp or file:PATH")),
    };
    if max_time.is_some_and(|t| !(t.is_finite() && t > 0.0)) {
        return Err("--max-time: give a positive number of seconds".into());
    }
    if progress_every.is_some_and(|t| !(t.is_finite() && t >= 0.0)) {
        return Err("--progress-every: give a number of seconds (0: every step)".into());
    }
    // A job's log gets a line every 30 s; a terminal has the progress bar.
    let progress_every = progress_every.or_else(|| {
        use std::io::IsTerminal;
        (!std::io::stderr().is_terminal()).then_some(30.0)
    });
    let world = world_from(|k| std::env::var(k).ok())?;
    let rank = world.rank;
    nnscaler_rt::train::run_bundle(&nnscaler_rt::train::BundleRun {
        dir: bundle.to_string(),
        resume,
        until,
        backend: backend.to_string(),
        ranks,
        world,
        rendezvous,
        timeout: std::time::Duration::from_secs(timeout),
        max_time,
        memory_limit,
        progress_every,
    })
    .map_err(|e| {
        if rank > 0 {
            format!("rank {rank}: {e}")
        } else {
            e
        }
    })
}

/// Sets the process's f32 matrix-product precision (`--matmul-precision`).
fn precision(p: &str) -> Result<(), String> {
    nnscaler_rt::precision::set(p.parse()?);
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match &cli.cmd {
        Cmd::Info { artifact } => info(artifact),
        Cmd::Run {
            artifact,
            inputs,
            output,
            backend,
            repeat,
            ranks,
            memory_limit,
            profile,
            matmul_precision,
            graph,
        } => precision(matmul_precision).and_then(|()| {
            run(
                artifact,
                inputs,
                output,
                backend,
                *repeat as usize,
                ranks.as_deref(),
                *memory_limit,
                (*profile, *graph),
            )
        }),
        Cmd::Compare {
            artifact,
            inputs,
            tolerance,
            top,
            drift,
        } => compare(artifact, inputs, *tolerance, *top, *drift),
        Cmd::Bench {
            manifest,
            output,
            runs,
            backend,
        } => bench(manifest, output, *runs as usize, backend),
        Cmd::Train {
            bundle,
            resume,
            until,
            backend,
            ranks,
            rendezvous,
            timeout,
            max_time,
            memory_limit,
            progress_every,
            matmul_precision,
        } => precision(matmul_precision).and_then(|()| {
            train(
                bundle,
                *resume,
                *until,
                backend,
                ranks.clone(),
                rendezvous,
                (*timeout, *max_time, *memory_limit, *progress_every),
            )
        }),
    };
    match r {
        Ok(s) => {
            print!("{s}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            // One write, so lines of processes sharing a terminal do not interleave.
            use std::io::Write;
            let _ = std::io::stderr().write_all(format!("nnscaler-rt: error: {e}\n").as_bytes());
            ExitCode::FAILURE
        }
    }
}

//! `nnscaler compile --target=cuda PROGRAM.mlir -o PROGRAM.nnsx`: a function compiled to
//! an artifact for `nnscaler-rt` (the format: `rt/src/artifact.rs`, `docs/gpu.md`).

use nnscaler_codegen::Gpu;
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::types::AttrValue;
use nnscaler_dialects::verify::Meshes;
use nnscaler_runtime::spmd::pipeline_programs;

/// `nnscaler compile`'s command line.
#[derive(clap::Args, Debug)]
#[command(
    about = "Compile a function to an artifact for nnscaler-rt (PTX, host kernels, launch and memory plan)",
    long_about = "Compile a function to an .nnsx artifact for nnscaler-rt: its ops as kernels \
        (elementwise chains fused), PTX for the GPU, the same kernels compiled for the host CPU \
        (a shared object, linked with $CC or cc), the launch plan and a memory plan (one arena, \
        space reused once no later step reads a buffer). Ops without GPU kernels are errors \
        naming them. The artifact is written only on success."
)]
pub struct CompileArgs {
    /// The program (MLIR file; '-' reads stdin).
    pub program: String,
    /// What to compile for.
    #[arg(long, default_value = "cuda", value_parser = ["cuda"])]
    pub target: String,
    /// The function (default: the only one, or @train).
    #[arg(long, value_name = "NAME")]
    pub func: Option<String>,
    /// The GPU's compute capability times ten (90: H100/H200).
    #[arg(long, default_value_t = 90, value_parser = clap::value_parser!(u32).range(50..=120))]
    pub sm: u32,
    /// The PTX ISA version times ten (80: PTX 8.0, loaded by CUDA 12 and 13 drivers).
    #[arg(long, default_value_t = 80, value_parser = clap::value_parser!(u32).range(60..=90))]
    pub ptx: u32,
    /// Where to write the artifact.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: String,
    /// Refuse an artifact whose runs would need more than this (the arenas of every
    /// program on every device, and the whole arguments and results: what nnscaler-rt
    /// checks before it allocates), e.g. the target GPU's memory, 80G; nothing is written.
    #[arg(long, value_name = "BYTES", value_parser = crate::cli::parse_bytes)]
    pub memory_limit: Option<u64>,
}

/// Runs the command; returns the summary to print.
pub fn main(a: &CompileArgs, error_limit: usize) -> Result<String, String> {
    let ir = IrContext::new();
    let (source, module) = crate::load_module(&ir, &a.program, error_limit)?;
    let render = |d: Diagnostics| -> String {
        d.in_file(&a.program)
            .render_limited(Some(&source), error_limit)
    };
    let funcs: Vec<Graph> = Graph::all_in(&module)
        .into_iter()
        .map(|f| {
            f.map_err(|e| {
                let mut d = Diagnostics::default();
                d.error(&e.loc, e.message);
                render(d)
            })
        })
        .collect::<Result<_, _>>()?;
    let names: Vec<&str> = funcs.iter().map(|g| g.name.as_str()).collect();
    let mut d = Diagnostics::default();
    let mesh = Meshes::collect(&module.as_operation(), &mut d)
        .0
        .first()
        .cloned();
    let gpu = Gpu {
        sm: a.sm,
        ptx: a.ptx,
    };
    let started = std::time::Instant::now();
    // A pipelined step (the programs of a --schedule-* pass) compiles as one artifact.
    let pipeline = pipeline_named(&funcs, a.func.as_deref());
    let (what, art) = if let Some(name) = pipeline {
        let mesh = mesh
            .as_ref()
            .ok_or_else(|| format!("{}: pipeline @{name} has no mesh", a.program))?;
        let programs =
            pipeline_programs(&funcs, &name).map_err(|e| format!("{}: {e}", a.program))?;
        let axis = pipeline_axis(&programs);
        let art = nnscaler_codegen::pipeline_artifact(
            &programs,
            &format!("{} @{name}", a.program),
            mesh,
            &axis,
            gpu,
        )
        .map_err(|e| format!("{}: pipeline @{name}: {e}", a.program))?;
        (
            format!("pipeline @{name} ({} programs)", programs.len()),
            art,
        )
    } else {
        let g = match &a.func {
            Some(f) => funcs.iter().find(|g| &g.name == f).ok_or_else(|| {
                format!(
                    "{}: no function @{f} (functions: {})",
                    a.program,
                    names.join(", ")
                )
            })?,
            None if funcs.len() == 1 => &funcs[0],
            None => funcs.iter().find(|g| g.name == "train").ok_or_else(|| {
                format!(
                    "{}: several functions ({}); choose one with --func",
                    a.program,
                    names.join(", ")
                )
            })?,
        };
        let mut g = g.clone();
        g.link(&funcs);
        let art = nnscaler_codegen::artifact(
            &g,
            &format!("{} @{}", a.program, g.name),
            mesh.as_ref(),
            gpu,
        )
        .map_err(|e| format!("{}: @{}: {e}", a.program, g.name))?;
        (format!("@{}", g.name), art)
    };
    // What a run of it needs, against the target's memory when given: refused before
    // anything is written.
    nnscaler_rt::memory::check(&art, a.memory_limit, None)
        .map_err(|e| format!("{}: {e}", a.program))?;
    let bytes = art.to_bytes()?;
    crate::write_one(&a.output, bytes.clone())?;
    let h = &art.header;
    let ptx = art.section("ptx").map_or(0, <[u8]>::len);
    let so = art.section("host.so").map_or(0, <[u8]>::len);
    let values: u64 = h
        .programs
        .iter()
        .flat_map(|p| &p.buffers)
        .map(|b| b.bytes())
        .sum();
    let arena = h.programs.iter().map(|p| p.arena_bytes).max().unwrap_or(0);
    Ok(format!(
        "compiled {what} for sm_{} in {:.1} s: {} kernels, {} steps; arena {} bytes for {} bytes of buffers (a run needs {} bytes with the whole arguments and results); PTX {} bytes, host kernels {} bytes; {} ({} bytes)\n",
        a.sm,
        started.elapsed().as_secs_f64(),
        h.kernels.len(),
        art.steps(),
        arena,
        values,
        nnscaler_rt::memory::arenas(&art).saturating_add(nnscaler_rt::memory::whole_tensors(&art)),
        ptx,
        so,
        a.output,
        bytes.len()
    ))
}

/// The pipeline `func` names (the value of its programs' `nns.pipeline`), or without
/// `func` the one a module of pipeline programs holds (`train`, or its only one).
pub fn pipeline_named<'a>(
    funcs: impl IntoIterator<Item = &'a Graph>,
    func: Option<&str>,
) -> Option<String> {
    let mut has_train = false;
    let mut pipelines: Vec<String> = funcs
        .into_iter()
        .filter_map(|f| {
            has_train |= f.name == "train";
            match f.func_attrs.get("nns.pipeline") {
                Some(AttrValue::Str(p)) => Some(p.clone()),
                _ => None,
            }
        })
        .collect();
    pipelines.sort();
    pipelines.dedup();
    match func {
        Some(f) => pipelines.iter().find(|p| *p == f).cloned(),
        None if pipelines.iter().any(|p| p == "train") && !has_train => Some("train".into()),
        None if pipelines.len() == 1 => pipelines.first().cloned(),
        None => None,
    }
}

/// The pipeline axis the programs' sends and receives name (`pp` when they have none).
pub fn pipeline_axis(programs: &[Graph]) -> String {
    programs
        .iter()
        .flat_map(|g| g.nodes.iter())
        .find_map(|n| match n.attrs.get("axis") {
            Some(AttrValue::Str(x)) if n.op == "nns.send" || n.op == "nns.recv" => Some(x.clone()),
            _ => None,
        })
        .unwrap_or_else(|| "pp".into())
}

/// A function compiled once and run many times (`nnscaler train --backend`).
#[derive(Debug)]
pub struct Compiled {
    backend: Backend,
    /// For a pipeline: each artifact argument's index among the step's arguments (its
    /// `nns.arg`); the step's arguments no program reads are not the artifact's.
    args: Option<Vec<usize>>,
    /// Every device on a thread of its own (nnscaler-rt's ranks) instead of lockstep.
    ranks: bool,
}

#[derive(Debug)]
enum Backend {
    /// Through nnscaler-rt's host backend.
    Host(nnscaler_rt::HostProgram),
    /// On GPU 0.
    #[cfg(feature = "cuda")]
    Cuda(nnscaler_rt::cuda::CudaProgram),
}

impl Compiled {
    /// Compiles `g` (whole, or one device's program on `mesh`) for `backend` ("host" or
    /// "cuda", the latter in binaries built with `--features cuda`).
    pub fn new(
        g: &Graph,
        mesh: Option<&nnscaler_dialects::nns::Mesh>,
        source: &str,
        backend: &str,
    ) -> Result<Self, String> {
        let art =
            nnscaler_codegen::artifact(g, &format!("{source} @{}", g.name), mesh, Gpu::default())?;
        Ok(Compiled {
            backend: Self::load(art, backend)?,
            args: None,
            ranks: false,
        })
    }

    /// Compiles pipeline `programs` (by rank, linked to their fragments) on `mesh`'s axis
    /// `axis` for `backend`.
    pub fn pipeline(
        programs: &[Graph],
        mesh: &nnscaler_dialects::nns::Mesh,
        axis: &str,
        source: &str,
        backend: &str,
    ) -> Result<Self, String> {
        let name = programs
            .first()
            .and_then(|g| match g.func_attrs.get("nns.pipeline") {
                Some(AttrValue::Str(p)) => Some(p.clone()),
                _ => None,
            })
            .unwrap_or_default();
        let art = nnscaler_codegen::pipeline_artifact(
            programs,
            &format!("{source} @{name}"),
            mesh,
            axis,
            Gpu::default(),
        )?;
        // The artifact's arguments: the indices the programs read, in order (as
        // `pipeline_artifact` numbers them).
        let args: std::collections::BTreeSet<usize> = programs
            .iter()
            .flat_map(|g| &g.args)
            .filter_map(|a| match a.attrs.get("nns.arg") {
                Some(AttrValue::Int(i)) if *i >= 0 => Some(*i as usize),
                _ => None,
            })
            .collect();
        Ok(Compiled {
            backend: Self::load(art, backend)?,
            args: Some(args.into_iter().collect()),
            ranks: false,
        })
    }

    /// Runs every device on a thread of its own (`nnscaler-rt run --ranks`: on the host
    /// through the in-process communicator, the same bits as lockstep; on CUDA one GPU
    /// per device through NCCL, or a stream per device on GPU 0 when the GPUs are fewer
    /// or NCCL does not load) when `on`, else all devices in lockstep.
    pub fn with_ranks(mut self, on: bool) -> Self {
        self.ranks = on;
        self
    }

    /// The program on the host backend (`None` on CUDA).
    pub fn host(&self) -> Option<&nnscaler_rt::HostProgram> {
        match &self.backend {
            Backend::Host(p) => Some(p),
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => None,
        }
    }

    /// The program on the CUDA backend (`None` on the host).
    #[cfg(feature = "cuda")]
    pub fn cuda(&self) -> Option<&nnscaler_rt::cuda::CudaProgram> {
        match &self.backend {
            Backend::Cuda(p) => Some(p),
            Backend::Host(_) => None,
        }
    }

    /// Whether every device runs on a thread of its own ([`Compiled::with_ranks`]).
    pub fn ranks(&self) -> bool {
        self.ranks
    }

    fn load(art: nnscaler_rt::Artifact, backend: &str) -> Result<Backend, String> {
        match backend {
            "host" => Ok(Backend::Host(nnscaler_rt::HostProgram::load(art)?)),
            #[cfg(feature = "cuda")]
            "cuda" => Ok(Backend::Cuda(nnscaler_rt::cuda::CudaProgram::load(art, 0)?)),
            #[cfg(not(feature = "cuda"))]
            "cuda" => Err("this nnscaler was built without the CUDA backend (cargo build --release -p nnscaler-tools --features cuda)".into()),
            other => Err(format!("unknown backend '{other}' (host, cuda)")),
        }
    }

    /// Runs it on whole tensors, every argument of the step in order (a pipeline's
    /// included, whether its programs read them or not); returns whole results (a
    /// pipeline's in the order of their `nns.result`).
    pub fn run(
        &self,
        inputs: &[nnscaler_runtime::tensor::Tensor],
    ) -> Result<Vec<nnscaler_runtime::tensor::Tensor>, String> {
        Ok(self.run_timed(inputs, 1)?.0)
    }

    /// [`Compiled::run`] `repeat` times (at least once): the last run's results and the
    /// seconds of each run's launch plan (nnscaler-rt's step time: the arguments already
    /// in place, the results not yet assembled).
    pub fn run_timed(
        &self,
        inputs: &[nnscaler_runtime::tensor::Tensor],
        repeat: usize,
    ) -> Result<(Vec<nnscaler_runtime::tensor::Tensor>, Vec<f64>), String> {
        let picked: Vec<&nnscaler_runtime::tensor::Tensor> = match &self.args {
            None => inputs.iter().collect(),
            Some(ids) => ids
                .iter()
                .map(|&i| {
                    inputs.get(i).ok_or_else(|| {
                        format!(
                            "the step has {} arguments; argument {i} is read",
                            inputs.len()
                        )
                    })
                })
                .collect::<Result<_, _>>()?,
        };
        self.run_args(&picked, repeat)
    }

    /// Runs it on a pipeline's arguments by their index among the step's (`nns.arg`):
    /// every one a program reads must be there.
    pub fn run_indexed(
        &self,
        inputs: &std::collections::BTreeMap<usize, nnscaler_runtime::tensor::Tensor>,
    ) -> Result<Vec<nnscaler_runtime::tensor::Tensor>, String> {
        Ok(self.run_indexed_timed(inputs, 1)?.0)
    }

    /// [`Compiled::run_indexed`] `repeat` times, as [`Compiled::run_timed`].
    pub fn run_indexed_timed(
        &self,
        inputs: &std::collections::BTreeMap<usize, nnscaler_runtime::tensor::Tensor>,
        repeat: usize,
    ) -> Result<(Vec<nnscaler_runtime::tensor::Tensor>, Vec<f64>), String> {
        let picked: Vec<&nnscaler_runtime::tensor::Tensor> = match &self.args {
            None => inputs.values().collect(),
            Some(ids) => ids
                .iter()
                .map(|i| {
                    inputs
                        .get(i)
                        .ok_or_else(|| format!("no value for argument {i}"))
                })
                .collect::<Result<_, _>>()?,
        };
        self.run_args(&picked, repeat)
    }

    /// [`Compiled::run`] on nnscaler-rt's tensors (no conversions).
    pub fn run_rt(
        &self,
        inputs: &[nnscaler_rt::Tensor],
    ) -> Result<Vec<nnscaler_rt::Tensor>, String> {
        let args: Vec<nnscaler_rt::Tensor> = match &self.args {
            None => inputs.to_vec(),
            Some(ids) => ids
                .iter()
                .map(|&i| {
                    inputs.get(i).cloned().ok_or_else(|| {
                        format!(
                            "the step has {} arguments; argument {i} is read",
                            inputs.len()
                        )
                    })
                })
                .collect::<Result<_, _>>()?,
        };
        Ok(self.run_on(&args, 1)?.0)
    }

    fn run_args(
        &self,
        inputs: &[&nnscaler_runtime::tensor::Tensor],
        repeat: usize,
    ) -> Result<(Vec<nnscaler_runtime::tensor::Tensor>, Vec<f64>), String> {
        let args: Vec<nnscaler_rt::Tensor> = inputs.iter().map(|&t| t.clone()).collect();
        self.run_on(&args, repeat)
    }

    fn run_on(
        &self,
        args: &[nnscaler_rt::Tensor],
        repeat: usize,
    ) -> Result<(Vec<nnscaler_rt::Tensor>, Vec<f64>), String> {
        let (outs, times) = match (&self.backend, self.ranks) {
            (Backend::Host(p), false) => p.run_timed(args, repeat)?,
            (Backend::Host(p), true) => p.run_ranks_timed(args, repeat)?,
            #[cfg(feature = "cuda")]
            (Backend::Cuda(p), false) => p.run_timed(args, repeat)?,
            #[cfg(feature = "cuda")]
            (Backend::Cuda(p), true) => {
                // A GPU per device where there are enough, else a stream per device.
                let (outs, times, line) = nnscaler_rt::streams::run_ranks(
                    p,
                    args,
                    repeat,
                    nnscaler_rt::streams::Placement::Auto,
                )?;
                eprintln!("nnscaler: {line}");
                (outs, times)
            }
        };
        Ok((outs, times))
    }
}

/// Runs `g` compiled (see [`Compiled`]; `ranks`: [`Compiled::with_ranks`]) `repeat`
/// times: the last run's results and each run's seconds ([`Compiled::run_timed`]).
pub fn run_compiled(
    g: &Graph,
    mesh: Option<&nnscaler_dialects::nns::Mesh>,
    source: &str,
    backend: &str,
    ranks: bool,
    inputs: Vec<nnscaler_runtime::tensor::Tensor>,
    repeat: usize,
) -> Result<(Vec<nnscaler_runtime::tensor::Tensor>, Vec<f64>), String> {
    Compiled::new(g, mesh, source, backend)?
        .with_ranks(ranks)
        .run_timed(&inputs, repeat)
}

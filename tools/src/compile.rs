//! `nnscaler compile --target=cuda PROGRAM.mlir -o PROGRAM.nnsx`: a function compiled to
//! an artifact for `nnscaler-rt` (the format: `rt/src/artifact.rs`, `docs/gpu.md`).

use crate::read_input;
use nnscaler_codegen::Gpu;
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::verify::{verify_module, Meshes};

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
}

/// Runs the command; returns the summary to print.
pub fn main(a: &CompileArgs, error_limit: usize) -> Result<String, String> {
    let source = read_input(&a.program)?;
    let ir = IrContext::new();
    let render = |d: Diagnostics| -> String {
        d.in_file(&a.program)
            .render_limited(Some(&source), error_limit)
    };
    crate::parse_guard::check_parses(&source, &a.program).map_err(render)?;
    let module = ir.parse(&source, &a.program).map_err(render)?;
    let d = verify_module(&module);
    if d.has_errors() {
        return Err(render(d));
    }
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
    let art =
        nnscaler_codegen::artifact(g, &format!("{} @{}", a.program, g.name), mesh.as_ref(), gpu)
            .map_err(|e| format!("{}: @{}: {e}", a.program, g.name))?;
    let bytes = art.to_bytes()?;
    crate::write_one(&a.output, bytes.clone())?;
    let h = &art.header;
    let ptx = art.section("ptx").map_or(0, <[u8]>::len);
    let so = art.section("host.so").map_or(0, <[u8]>::len);
    let values: u64 = h.buffers.iter().map(|b| b.bytes()).sum();
    Ok(format!(
        "compiled @{} for sm_{} in {:.1} s: {} kernels, {} steps; arena {} bytes for {} bytes of buffers; PTX {} bytes, host kernels {} bytes; {} ({} bytes)\n",
        g.name,
        a.sm,
        started.elapsed().as_secs_f64(),
        h.kernels.len(),
        h.steps.len(),
        h.arena_bytes,
        values,
        ptx,
        so,
        a.output,
        bytes.len()
    ))
}

/// A function compiled once and run many times (`nnscaler train --backend`).
#[derive(Debug)]
pub enum Compiled {
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
        match backend {
            "host" => Ok(Compiled::Host(nnscaler_rt::HostProgram::load(art)?)),
            #[cfg(feature = "cuda")]
            "cuda" => Ok(Compiled::Cuda(nnscaler_rt::cuda::CudaProgram::load(art, 0)?)),
            #[cfg(not(feature = "cuda"))]
            "cuda" => Err("this nnscaler was built without the CUDA backend (cargo build --release -p nnscaler-tools --features cuda)".into()),
            other => Err(format!("unknown backend '{other}' (host, cuda)")),
        }
    }

    /// Runs it on whole tensors; returns whole results.
    pub fn run(
        &self,
        inputs: &[nnscaler_runtime::tensor::Tensor],
    ) -> Result<Vec<nnscaler_runtime::tensor::Tensor>, String> {
        let args: Vec<nnscaler_rt::Tensor> = inputs.iter().map(to_rt).collect::<Result<_, _>>()?;
        let outs = match self {
            Compiled::Host(p) => p.run(&args)?,
            #[cfg(feature = "cuda")]
            Compiled::Cuda(p) => p.run_timed(&args, 1)?.0,
        };
        outs.iter().map(from_rt).collect()
    }
}

/// Runs `g` once compiled (see [`Compiled`]).
pub fn run_compiled(
    g: &Graph,
    mesh: Option<&nnscaler_dialects::nns::Mesh>,
    source: &str,
    backend: &str,
    inputs: Vec<nnscaler_runtime::tensor::Tensor>,
) -> Result<Vec<nnscaler_runtime::tensor::Tensor>, String> {
    Compiled::new(g, mesh, source, backend)?.run(&inputs)
}

fn to_rt(t: &nnscaler_runtime::tensor::Tensor) -> Result<nnscaler_rt::Tensor, String> {
    let shape = t.shape.iter().map(|&d| d as u64).collect();
    let data = match t.f() {
        Ok(v) => nnscaler_rt::Values::F32(v.to_vec()),
        Err(_) => nnscaler_rt::Values::I64(t.ints()?.to_vec()),
    };
    Ok(nnscaler_rt::Tensor { shape, data })
}

fn from_rt(t: &nnscaler_rt::Tensor) -> Result<nnscaler_runtime::tensor::Tensor, String> {
    let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
    Ok(match &t.data {
        nnscaler_rt::Values::F32(v) => nnscaler_runtime::tensor::Tensor::f32(&shape, v.clone()),
        nnscaler_rt::Values::I64(v) => nnscaler_runtime::tensor::Tensor::i64(&shape, v.clone()),
    })
}
